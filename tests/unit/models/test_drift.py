"""Regime changes: the in-house Page-Hinkley test and RegimeDetector on known shifts."""

from __future__ import annotations

import numpy as np
import pytest
from river import drift as river_drift

from perfloop.models.drift import PageHinkley, RegimeDetector


@pytest.mark.parametrize("seed", range(5))
def test_page_hinkley_flags_the_same_values_as_rivers(seed: int) -> None:
    rng = np.random.default_rng(seed)
    xs = np.r_[rng.normal(1.0, 0.05, 300), rng.normal(1.3, 0.05, 200), rng.normal(0.9, 0.1, 300)]
    ours = PageHinkley(min_instances=20, threshold=0.5)
    theirs = river_drift.PageHinkley(min_instances=20, threshold=0.5)
    flagged_ours, flagged_theirs = [], []
    for i, v in enumerate(xs.tolist()):
        if ours.update(v):
            flagged_ours.append(i)
        theirs.update(v)
        if theirs.drift_detected:
            flagged_theirs.append(i)
    assert flagged_ours == flagged_theirs
    assert any(300 <= i < 310 for i in flagged_ours), "the rise at 300 is flagged at once"


@pytest.mark.parametrize("method", ["page_hinkley", "adwin"])
def test_a_lasting_shift_is_one_change_and_noise_is_none(method: str) -> None:
    rng = np.random.default_rng(7)
    d = RegimeDetector(features=("step_time_ms", "data_wait_share"), method=method)
    changes = []
    for t in range(2000):
        wait = 0.05 if t < 1000 else 0.25
        d.learn_one({"step_time_ms": 100 / (1 - wait) + rng.normal(0, 2), "data_wait_share": wait})
        if d.changed:
            changes.append((t, d.changed))
    assert len(changes) == 1, changes
    ((t, moved),) = changes
    assert 1000 <= t < 1060 and "step_time_ms" in moved


def test_the_detector_does_not_import_river_unless_adwin_is_asked_for() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from perfloop.models.drift import RegimeDetector; "
        "d = RegimeDetector(); [d.learn_one({'step_time_ms': 100.0}) for _ in range(50)]; "
        "print('river' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
