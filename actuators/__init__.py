"""Optimization tier: turn recommendations into safe, signed changes the job applies.

Contract: the service (`ActuatorService`, deciding with `Policy`) publishes signed commands
on ``perfloop.control``; the `JobAgent` inside the training process verifies each one
(signature, expiry, sequence, bounds), applies it at the next step boundary and acks it on
``perfloop.actuations``. An invalid command changes nothing and is acked as rejected.
"""

from perfloop.actuators.agent import (
    ConfigHandler,
    ConfigListener,
    JobAgent,
    KnobHandler,
    apply_config,
)
from perfloop.actuators.service import KNOB_BOUNDS, ActuatorService, Policy
from perfloop.actuators.signing import sign, signature_of, verify

__all__ = [
    "KNOB_BOUNDS",
    "ActuatorService",
    "ConfigHandler",
    "ConfigListener",
    "JobAgent",
    "KnobHandler",
    "Policy",
    "apply_config",
    "sign",
    "signature_of",
    "verify",
]
