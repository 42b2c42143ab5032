"""Slow-loop changes: a config patch the job reads when it restarts.

Some knobs cannot change while a job runs (its batch size, its precision): a command for the
slow loop is not applied between steps but recorded in the job's config patch, a JSON file
(``$PERFLOOP_HOME/patches/<job>.json`` by default, ``PERFLOOP_CONFIG_PATCH`` to choose). The
job agent writes it (atomically: a reader never sees half a file) and acks the command as
applied with the file's path; ``perfloop run`` passes the file to the command it starts
(``PERFLOOP_CONFIG_PATCH``) and prints what it holds; a script's `perfloop.producers.tunable`
takes its starting value from the patch, and any launcher can read the file itself:

.. code-block:: json

    {"job_id": "llm-7", "updated_ns": 1795738037356597000,
     "values": {"train.batch_size": 64},
     "changes": [{"knob": "train.batch_size", "from": 32, "value": 64,
                  "command_id": "…", "rec_id": "…", "ts_ns": 1795738037356597000}]}

``values`` is what to use; ``changes`` is the history, newest last.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from perfloop.exceptions import ConfigError
from perfloop.schemas import Command, KnobValue

__all__ = ["ConfigPatch", "patch_path", "read_patch"]

MAX_CHANGES = 100
"""Changes kept in a patch's history."""


def patch_path(home: Path, job_id: str) -> Path:
    """The default patch file of a job (its id made safe as a file name).

    >>> patch_path(Path("/h"), "team/llm-7:v2").as_posix()
    '/h/patches/team_llm-7_v2.json'
    """
    return home / "patches" / f"{re.sub(r'[^A-Za-z0-9._@+-]', '_', job_id)}.json"


def read_patch(path: Path | str) -> dict[str, KnobValue]:
    """The values a patch file holds ({} when there is none); `ConfigError` if unreadable."""
    p = Path(path)
    try:
        doc = orjson.loads(p.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, orjson.JSONDecodeError) as e:
        raise ConfigError(f"config patch {p} is unreadable: {e}") from e
    values = doc.get("values") if isinstance(doc, dict) else None
    if not isinstance(values, dict):
        raise ConfigError(f"config patch {p} has no 'values' object")
    return dict(values)


class ConfigPatch:
    """A job's config patch file.

    >>> import tempfile
    >>> patch = ConfigPatch(Path(tempfile.mkdtemp()) / "j.json", job_id="j")
    >>> cmd = Command(ts_ns=1, job_id="j", node="n", rank=-1, seq=1, knob="train.batch_size",
    ...               from_value=32, value=64, loop="slow", expires_ts_ns=10)
    >>> patch.record(cmd)
    >>> read_patch(patch.path)
    {'train.batch_size': 64}
    """

    def __init__(self, path: Path, *, job_id: str) -> None:
        self.path, self.job_id = path, job_id

    def record(self, cmd: Command) -> None:
        """Add the command's change to the patch; `ConfigError` if the file cannot be written
        (nothing changed then)."""
        try:
            doc: dict[str, Any] = orjson.loads(self.path.read_bytes())
            if not isinstance(doc, dict):
                doc = {}
        except FileNotFoundError:
            doc = {}
        except (OSError, orjson.JSONDecodeError) as e:
            raise ConfigError(f"config patch {self.path} is unreadable: {e}") from e
        values = dict(doc.get("values") or {})
        values[cmd.knob] = cmd.value
        change = {
            "knob": cmd.knob,
            "from": cmd.from_value,
            "value": cmd.value,
            "command_id": cmd.event_id,
            "rec_id": cmd.rec_id,
            "ts_ns": cmd.ts_ns,
        }
        changes = [*list(doc.get("changes") or [])[-(MAX_CHANGES - 1) :], change]
        out = {"job_id": self.job_id, "updated_ns": time.time_ns(), "values": values,
               "changes": changes}  # fmt: skip
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".patch-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(orjson.dumps(out, option=orjson.OPT_INDENT_2))
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            raise ConfigError(f"cannot write the config patch {self.path}: {e}") from e
