"""The stream tier's signature on what it recommends (`perfloop.actuators.trust`).

With ``recommendation_private_key`` every recommendation leaves the worker signed with it
(Ed25519; ``key_id`` its public key's) and with an expiry ``recommendation_ttl_s`` of wall
time ahead, so an actuator holding the public key acts on no recommendation the stream tier
did not make, nor on one held back and sent later. Without the key they leave as they are.

>>> from perfloop.identity import PrivateKey
>>> from perfloop.schemas import Recommendation
>>> rec = Recommendation(ts_ns=1, job_id="j", node="n", rank=-1, knob="k", from_value=1,
...     to_value=2, loop="fast", expected_gain_pct=10, confidence=0.5, rationale="r")
>>> key = PrivateKey.generate()
>>> signed = RecommendationSigner(key, ttl_s=60)([rec])[0]
>>> signed.key_id == key.key_id, signed.expires_ts_ns > 0, signed.signature[:8]
(True, True, 'ed25519:')
>>> RecommendationSigner(None, ttl_s=60)([rec])[0] is rec
True
"""

from __future__ import annotations

import time

from perfloop.actuators.signing import sign
from perfloop.identity import PrivateKey
from perfloop.schemas import Recommendation
from perfloop.settings import StreamsSettings

__all__ = ["RecommendationSigner"]


class RecommendationSigner:
    """Signs a worker's recommendations as they are published (see the module)."""

    def __init__(self, key: PrivateKey | None, *, ttl_s: float) -> None:
        self.key = key
        self.ttl_ns = int(ttl_s * 1e9)

    @classmethod
    def of(cls, settings: StreamsSettings) -> RecommendationSigner:
        """From the worker's settings; a key that does not read is one `ConfigError` line."""
        path = settings.recommendation_private_key
        key = PrivateKey.load(path) if path is not None else None
        return cls(key, ttl_s=settings.recommendation_ttl_s)

    def __call__(self, recs: list[Recommendation]) -> list[Recommendation]:
        if self.key is None or not recs:
            return recs
        expires = time.time_ns() + self.ttl_ns
        return [sign(r.model_copy(update={"expires_ts_ns": expires}), self.key) for r in recs]
