"""The GPU power-limit helper: the one privileged process of a node that sets power limits.

Setting a GPU's power limit through NVML takes root. A training process should not run as
root, so on a node where perfloop may change power limits a small helper does it instead
(`perfloop power-helper`, run as root by the node's service manager) and the training
processes hand it the command they were sent (``PERFLOOP_POWER_HELPER``: the helper's socket).
The helper trusts nothing the process says: it applies only

- a ``gpu.power_limit_w`` command signed with an Ed25519 key of its own keyring (the
  actuator's public keys, ``--keyring``; a shared-key signature, which any job host can make,
  is refused), not expired, not seen before, with a sequence number above the last it applied
  for that job;
- a number of watts within every named GPU's range, read from the hardware; every GPU is set,
  or, when one refuses, the ones already set are put back;

and it undoes (``restore``) only a command it applied, for the same user, back to the limits
it read before. Every request gets one JSON line back (``ok``, or ``error`` with the reason,
which the job's agent acks the command with); every decision is one line in the helper's log.

The protocol, one JSON object per line over a Unix stream socket::

    {"op": "range", "devices": [0, 1]}                     -> {"ok": true, "range": [lo, hi]}
    {"op": "apply", "command": "<the command as it came>", "devices": [0, 1]}
    {"op": "restore", "command_id": "<its event id>", "devices": [0, 1]}
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perfloop.actuators.signing import check_signature
from perfloop.exceptions import ConfigError
from perfloop.identity import KeyringFile
from perfloop.producers._power import KNOB, power_limit_range
from perfloop.producers.gpu import GpuBackend
from perfloop.schemas import Command, KnobValue, SchemaError, decode_event

__all__ = ["PowerHelper", "helper_handler", "helper_range", "serve"]

log = logging.getLogger("perfloop.power_helper")

MAX_REQUEST_BYTES = 64 << 10
REMEMBERED = 1024
"""Commands applied that the helper remembers (to refuse a replay, and to undo one)."""


@dataclass
class _Applied:
    uid: int
    job_id: str
    before: dict[int, float]


class PowerHelper:
    """Decides on requests (`handle`) and applies them through ``backend`` (an opened
    `GpuBackend`: `NvmlBackend` on a node). ``keyring`` holds the public keys commands must be
    signed with."""

    def __init__(
        self,
        backend: GpuBackend,
        keyring: KeyringFile,
        *,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.backend = backend
        self.keyring = keyring
        self._clock = clock
        self._applied: OrderedDict[str, _Applied] = OrderedDict()
        self._last_seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def handle(self, request: Any, *, uid: int, pid: int = 0) -> dict[str, Any]:
        """The answer to one request from the process ``pid`` of user ``uid``; never raises."""
        try:
            if not isinstance(request, dict):
                raise ConfigError("a request is a JSON object")
            op = request.get("op")
            devices = _devices(request.get("devices"))
            with self._lock:
                if op == "range":
                    return {"ok": True, "range": list(power_limit_range(self.backend, devices))}
                if op == "apply":
                    return self._apply(request.get("command"), devices, uid=uid, pid=pid)
                if op == "restore":
                    return self._restore(request.get("command_id"), devices, uid=uid, pid=pid)
            raise ConfigError(f"unknown op {op!r}; ops: range, apply, restore")
        except ConfigError as e:
            return {"ok": False, "error": _line(str(e))}
        except Exception as e:  # a defect, or the hardware: refused, the helper goes on
            log.exception("power helper: request from pid %d failed", pid)
            return {"ok": False, "error": _line(f"{type(e).__name__}: {e}")}

    def check(self, cmd: Command, *, now_ns: int) -> str:
        """Why ``cmd`` is not to be applied ("" when it is)."""
        if cmd.knob != KNOB:
            return f"this helper sets {KNOB} only, not {cmd.knob}"
        why = check_signature(cmd, key=None, keyring=self.keyring.current(), now_ns=now_ns)
        if why:
            return why
        if cmd.expires_ts_ns <= now_ns:
            return f"expired {(now_ns - cmd.expires_ts_ns) / 1e9:.1f} s ago"
        if cmd.event_id in self._applied:
            return f"command {cmd.event_id} was applied already (replayed)"
        last = self._last_seq.get(cmd.job_id, 0)
        if cmd.seq <= last:
            return f"sequence {cmd.seq} of job {cmd.job_id} is not after {last} (replayed)"
        return ""

    def _apply(self, raw: Any, devices: tuple[int, ...], *, uid: int, pid: int) -> dict[str, Any]:
        if not isinstance(raw, str):
            raise ConfigError("apply needs the command as it came, a JSON string")
        try:
            cmd = decode_event(raw.encode())
        except SchemaError as e:
            raise ConfigError(f"not a command: {e}") from None
        if not isinstance(cmd, Command):
            raise ConfigError(f"not a command: a {cmd.KIND} event")
        why = self.check(cmd, now_ns=self._clock())
        if why:
            log.warning(
                "power helper: refused %s (job %s, seq %d, key %s) from pid %d uid %d: %s",
                cmd.event_id, cmd.job_id, cmd.seq, cmd.key_id, pid, uid, why,
            )  # fmt: skip
            return {"ok": False, "error": why}
        watts = _watts(cmd.value)
        before = _set_all(self.backend, devices, watts, cmd.value)
        self._applied[cmd.event_id] = _Applied(uid, cmd.job_id, before)
        while len(self._applied) > REMEMBERED:
            self._applied.popitem(last=False)
        self._last_seq[cmd.job_id] = cmd.seq
        log.info("power helper: %s = %g W on GPU %s for job %s (command %s, seq %d, key %s) "
                 "from pid %d uid %d", KNOB, watts, list(devices), cmd.job_id, cmd.event_id,
                 cmd.seq, cmd.key_id, pid, uid)  # fmt: skip
        return {"ok": True, "before": {str(d): w for d, w in before.items()}}

    def _restore(
        self, command_id: Any, devices: tuple[int, ...], *, uid: int, pid: int
    ) -> dict[str, Any]:
        done = self._applied.get(command_id) if isinstance(command_id, str) else None
        if done is None:
            raise ConfigError(f"command {command_id!r} was not applied here: nothing to undo")
        if done.uid != uid:
            raise ConfigError(f"command {command_id} was applied for another user")
        if set(devices) != set(done.before):
            raise ConfigError(
                f"command {command_id} set GPU {sorted(done.before)}, not {list(devices)}"
            )
        for d, watts in done.before.items():
            self.backend.set_power_limit_w(d, watts)
        del self._applied[command_id]
        log.info("power helper: command %s of job %s undone (GPU limits back to %s) for pid %d "
                 "uid %d", command_id, done.job_id, done.before, pid, uid)  # fmt: skip
        return {"ok": True}


def _line(text: str) -> str:
    return " ".join(text.split())[:500]


def _devices(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or len(value) > 64:
        raise ConfigError("devices: a list of 1 to 64 GPU indices")
    if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in value):
        raise ConfigError(f"devices: GPU indices are integers ≥ 0, not {value!r}")
    return tuple(dict.fromkeys(value))


def _watts(value: KnobValue) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigError(f"{KNOB}={value!r} is not a number of watts")
    return float(value)


def _set_all(
    backend: GpuBackend, devices: Sequence[int], watts: float, value: KnobValue
) -> dict[int, float]:
    """Set every device, each checked against its own range first; on a refusal put back the
    ones already set and raise. Return each device's limit before."""
    for d in devices:
        lo, hi = backend.power_limit_range_w(d)
        if not lo <= watts <= hi:
            raise ConfigError(f"{KNOB}={value!r} is outside GPU {d}'s range [{lo:g}, {hi:g}] W")
    before: dict[int, float] = {}
    for d in devices:
        try:
            before[d] = backend.set_power_limit_w(d, watts)
        except Exception as e:
            for done, w in reversed(list(before.items())):
                with contextlib.suppress(Exception):
                    backend.set_power_limit_w(done, w)
            raise ConfigError(f"{KNOB}={value!r} not applied: GPU {d}: {_line(str(e))}; "
                              f"the GPUs set before it were put back") from e  # fmt: skip
    return before


# -- the socket ---------------------------------------------------------------------------


def serve(path: Path, helper: PowerHelper, stop: threading.Event, *, mode: int = 0o660,
          gid: int | None = None) -> None:  # fmt: skip
    """Answer requests on the Unix socket ``path`` (made with ``mode``, group ``gid``) until
    ``stop`` is set; one request at a time, each connection at most 5 s."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        srv.bind(str(path))
        os.chmod(path, mode)
        if gid is not None:
            os.chown(path, -1, gid)
        srv.listen(16)
        srv.settimeout(0.5)
        log.info("power helper: listening on %s", path)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                _answer(conn, helper)
    finally:
        srv.close()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _answer(conn: socket.socket, helper: PowerHelper) -> None:
    conn.settimeout(5.0)
    pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    data = b""
    try:
        while b"\n" not in data and len(data) <= MAX_REQUEST_BYTES:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            reply: dict[str, Any] = {
                "ok": False,
                "error": f"request over {MAX_REQUEST_BYTES} bytes",
            }
        else:
            try:
                request = json.loads(data.split(b"\n", 1)[0] or b"null")
            except ValueError as e:
                reply = {"ok": False, "error": f"not JSON: {e}"}
            else:
                reply = helper.handle(request, uid=uid, pid=pid)
        conn.sendall(json.dumps(reply).encode() + b"\n")
    except OSError as e:  # the client went away: nothing to answer
        log.warning("power helper: pid %d: %s", pid, e)


# -- the client (in the training process) -------------------------------------------------


def _ask(path: Path, request: dict[str, Any], timeout_s: float = 10.0) -> dict[str, Any]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while b"\n" not in data:
                chunk = s.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise ConfigError(f"the power helper at {path} does not answer: {e}") from None
    try:
        reply = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        raise ConfigError(f"the power helper at {path} answered no JSON") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        error = reply.get("error") if isinstance(reply, dict) else reply
        raise ConfigError(f"the power helper refused: {error}")
    return reply


def helper_range(path: Path, devices: Sequence[int]) -> tuple[float, float]:
    """The power limits every one of ``devices`` accepts, as the helper reads them."""
    lo, hi = _ask(path, {"op": "range", "devices": list(devices)})["range"]
    return float(lo), float(hi)


def helper_handler(path: Path, devices: Sequence[int]) -> Callable[[KnobValue], None]:
    """The job agent's handler for ``gpu.power_limit_w`` through the helper: it sends the
    verified command being applied (or asks the helper to undo it, for a rollback); raises
    `ConfigError` with the helper's reason when refused."""
    from perfloop.actuators.agent import APPLYING
    from perfloop.schemas import encode_event

    devs = list(devices)

    def set_power_limit(value: KnobValue) -> None:
        current = APPLYING.get()
        if current is None:
            raise ConfigError(f"{KNOB} is set only for a command the job agent verified")
        cmd, undo = current
        if undo:
            _ask(path, {"op": "restore", "command_id": cmd.event_id, "devices": devs})
        else:
            _ask(path, {"op": "apply", "command": encode_event(cmd).decode(), "devices": devs})

    return set_power_limit
