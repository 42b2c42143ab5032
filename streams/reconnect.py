"""The stream worker's Kafka client asks the bootstrap address again when no broker it knows
answers (`rebootstrap_when_lost`).

Faust's consumer and producer are aiokafka's. aiokafka bootstraps once: afterwards it asks
only the brokers the metadata named for metadata, so a broker that moved to another address
is never found again. The embedded broker does move: each broker process has a port of its
own behind the stack's address (`perfloop.stack._front`), and a recycle or a crash replaces
the process. With this, a metadata update that reached no known broker bootstraps again from
the configured address, which answers with the broker of the moment, and is tried once more.
A cluster whose brokers keep their addresses never takes this path.
"""

from __future__ import annotations

import logging
from typing import Any

from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaConnectionError

__all__ = ["rebootstrap_when_lost"]

log = logging.getLogger(__name__)

_original = AIOKafkaClient._metadata_update


async def _metadata_update(self: AIOKafkaClient, cluster_metadata: Any, topics: Any) -> bool:
    if await _original(self, cluster_metadata, topics):
        return True
    try:
        await self.bootstrap()  # the configured address: the broker of the moment
    except KafkaConnectionError as e:
        log.warning("no broker answers, nor the bootstrap address: %s", e)
        return False
    log.info("the brokers it knew are gone: bootstrapped again, now %s", self.cluster.brokers())
    return bool(await _original(self, cluster_metadata, topics))


def rebootstrap_when_lost() -> None:
    """Give every aiokafka client of this process the fallback (idempotent)."""
    AIOKafkaClient._metadata_update = _metadata_update  # type: ignore[method-assign]
