"""Before each module, garbage from the modules before it is collected, in this process.

Job agents made by the unit tests hold Kafka clients in reference cycles (agent ↔ its
thread). Finalized inside a process forked later (a DataLoader worker of another test), such
a client crashes that worker; collected here, it is released where it was made.
"""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True, scope="module")
def _collect_before_forking() -> None:
    gc.collect()
