"""The environment `perfloop run` gives the command it runs: the run bootstrap first on
``PYTHONPATH`` (its ``sitecustomize`` installs the training hooks in every Python process that
imports torch; any ``sitecustomize`` it shadows still runs) and the run in ``PERFLOOP_*``
variables. The command itself: `perfloop.cli.run`."""

from __future__ import annotations

import logging
import os
import shlex
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from perfloop.deprecation import moved

__all__ = ["BOOTSTRAP_DIR", "child_env", "new_job_id"]

__getattr__ = moved(__name__, {"run_command": "perfloop.cli.run"})

log = logging.getLogger("perfloop.producers")

BOOTSTRAP_DIR = Path(__file__).resolve().parent / "_bootstrap"
"""The folder holding the run bootstrap (``sitecustomize.py``)."""


def new_job_id() -> str:
    """A fresh job id: ``run-<UTC time>-<6 hex>``.

    >>> import re; bool(re.fullmatch(r"run-\\d{8}T\\d{6}-[0-9a-f]{6}", new_job_id()))
    True
    """
    return f"run-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:6]}"


def child_env(
    base: Mapping[str, str], *, job_id: str, node: str, command: Sequence[str]
) -> dict[str, str]:
    """The command's environment: ``base`` plus the bootstrap on PYTHONPATH and the run.

    >>> env = child_env({"PYTHONPATH": "/src"}, job_id="j1", node="n0", command=["python", "t.py"])
    >>> env["PYTHONPATH"].split(os.pathsep)[1], env["PERFLOOP_JOB_ID"], env["PERFLOOP_RUN_HOOKS"]
    ('/src', 'j1', '1')
    >>> env["PERFLOOP_RUN_COMMAND"]
    'python t.py'
    """
    env = dict(base)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    boot = str(BOOTSTRAP_DIR)
    env["PYTHONPATH"] = os.pathsep.join([boot, *(p for p in paths if p != boot)])
    env["PERFLOOP_JOB_ID"] = job_id
    env["PERFLOOP_NODE"] = node
    env["PERFLOOP_RUN_HOOKS"] = "1"
    env["PERFLOOP_RUN_COMMAND"] = shlex.join(command)[:4096]
    return env
