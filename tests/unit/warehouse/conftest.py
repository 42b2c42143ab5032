"""The sink's retries wait milliseconds in its unit tests, not seconds."""

from __future__ import annotations

import pytest

from perfloop.warehouse import sink as sink_mod


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sink_mod, "RETRY_FIRST_S", 0.01)
    monkeypatch.setattr(sink_mod, "RETRY_MAX_S", 0.02)
