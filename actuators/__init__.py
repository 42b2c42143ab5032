"""Optimization tier: turn recommendations into safe, signed changes the job applies.

Contract: the service (`ActuatorService`, deciding with `Policy` by each job's `JobRules`:
automation tier, dry run, bounds, hysteresis, cooldown, rate limit) publishes signed commands
on ``perfloop.control`` and every decision (`Decision`) on ``perfloop.actuations``; a person's
signed `Approval` (``perfloop approve``) releases a recommendation pending in tier ``approve``.
With a keyring of recommender keys and a roster of principals (`perfloop.actuators.trust`), only
recommendations the stream tier signed and approvals and settings a principal signed within
their role are taken; every refusal is a decision in ``audit``.
The `JobAgent` inside the training process verifies each command (signature, expiry,
sequence, bounds), applies it at the next step boundary and acks it on
``perfloop.actuations``; then judges it from the steps around it (`ChangeVerifier`) and keeps
it or rolls it back to the last value known good (a slowdown above 3 % that is not yet
significant is judged on more steps), and says each change on the job's stderr. An invalid
command, or one for a knob the user pinned, changes nothing and is acked as rejected.

A job that ended gets nothing more. A straggler's node (``cluster.drain_node``) is never sent to
a job: the service runs the operator's action hook for it (`perfloop.actuators.hook`), as the
job's tier allows, and audits how it went.
"""

from perfloop.actuators.agent import (
    ConfigHandler,
    ConfigListener,
    JobAgent,
    KnobHandler,
    apply_config,
)
from perfloop.actuators.policy import KNOB_BOUNDS, JobRules, Policy
from perfloop.actuators.service import ActuatorService
from perfloop.actuators.signing import sign, signature_of, verify
from perfloop.actuators.verification import ChangeVerifier, Verdict

__all__ = [
    "KNOB_BOUNDS",
    "ActuatorService",
    "ChangeVerifier",
    "ConfigHandler",
    "ConfigListener",
    "JobAgent",
    "JobRules",
    "KnobHandler",
    "Policy",
    "Verdict",
    "apply_config",
    "sign",
    "signature_of",
    "verify",
]
