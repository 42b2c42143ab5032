"""`ChangeVerifier` on step times recorded from real CPU training on a 2-core machine shared with
other jobs (``data/step_times_*.txt``: steady, drifting with the machine's load, and contended
by an oversubscribed thread pool).

Each case slides over a recording: 60 real steps before a change, then the next 62 real steps
scaled by the change's true effect, the first two three times as slow (the warm-up a rebuilt
loader or thread pool has), and counts what the verifier decided over every position. The
noise is the recording's own: heavy tails, bursts, load that drifts. Every threshold below is
set well under what the verifier measures on these recordings (noted beside it), so a change to
the judgement that makes it less robust fails here.

What the user relies on: a helpful change is kept; a harmful one is rolled back; a borderline
one (+3 … +15 %, noisy) is kept far less often than by significance alone (the rule the issue
caught keeping +13.2 % at p = 0.613); no kept change is slower than 3 % by the median it was
judged on; a change made only for speed (``must_help``) is kept only when it was measured
faster; each verdict says what it was judged on.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import pytest

from perfloop.actuators.verification import MIN_BASELINE, ChangeVerifier, Verdict, mann_whitney_p

DATA = Path(__file__).parent / "data"
SETTLE, VERIFY, HISTORY = 2, 20, 60


@cache
def recording(name: str) -> np.ndarray:
    return np.loadtxt(DATA / f"step_times_{name}.txt")


@cache
def verdicts(name: str, effect: float, must_help: bool = False) -> list[Verdict]:
    """The verdict at every 5th position of the recording, for a change of true ``effect``."""
    x, out = recording(name), []
    n_after = SETTLE + 3 * VERIFY
    for i in range(0, len(x) - HISTORY - n_after, 5):
        v = ChangeVerifier(
            x[i : i + HISTORY], settle_steps=SETTLE, verify_steps=VERIFY, must_help=must_help
        )
        after = x[i + HISTORY : i + HISTORY + n_after] * effect
        after[:SETTLE] *= 3
        verdict = None
        for t in after:
            verdict = v.observe(float(t))
            if verdict is not None:
                break
        assert verdict is not None, "a verdict within settle + 3 × verify steps"
        out.append(verdict)
    return out


def kept(name: str, effect: float, must_help: bool = False) -> float:
    vs = verdicts(name, effect, must_help)
    return sum(not v.rollback for v in vs) / len(vs)


def kept_by_significance_alone(name: str, effect: float) -> float:
    """The rule before issue 21: 10 steps before, 20 after; rolled back only when p < 0.05."""
    x, n = recording(name), 0
    outcomes = []
    for i in range(0, len(x) - HISTORY - SETTLE - 3 * VERIFY, 5):
        before = x[i + HISTORY - 10 : i + HISTORY]
        after = x[i + HISTORY + SETTLE : i + HISTORY + SETTLE + VERIFY] * effect
        ratio = np.median(after) / np.median(before)
        outcomes.append(not (mann_whitney_p(before, after) < 0.05 and ratio > 1.03))
        n += 1
    return sum(outcomes) / n


@pytest.mark.parametrize(
    ("name", "effect", "at_least"),
    [
        ("steady", 0.75, 0.98),  # measured 1.00
        ("steady", 0.90, 0.95),  # 0.99
        ("drifting", 0.75, 0.9),  # 0.97
        ("contended", 0.75, 0.8),  # 0.87
    ],
)
def test_a_helpful_change_is_kept(name: str, effect: float, at_least: float) -> None:
    assert kept(name, effect) >= at_least


@pytest.mark.parametrize(
    ("name", "at_least"),
    [("steady", 0.75), ("drifting", 0.6), ("contended", 0.6)],  # measured 0.80, 0.68, 0.66
)
def test_most_neutral_changes_are_kept(name: str, at_least: float) -> None:
    """A neutral change rolled back costs nothing; still, most are kept."""
    assert kept(name, 1.0) >= at_least


@pytest.mark.parametrize(
    ("name", "at_least"),
    [("steady", 0.98), ("drifting", 0.75), ("contended", 0.75)],  # measured 1.00, 0.85, 0.84
)
def test_a_helpful_speed_change_is_kept(name: str, at_least: float) -> None:
    """``must_help`` (loader workers, threads): a 25 % gain is still kept."""
    assert kept(name, 0.75, must_help=True) >= at_least


@pytest.mark.parametrize(
    ("name", "at_most"),
    [("steady", 0.25), ("drifting", 0.4), ("contended", 0.45)],  # measured 0.15, 0.25, 0.32
)
def test_most_neutral_speed_changes_are_rolled_back(name: str, at_most: float) -> None:
    """``must_help``: no measured gain, no reason to keep it (kept only when the steps after it
    happened to run faster: load that drifted down)."""
    assert kept(name, 1.0, must_help=True) <= at_most


@pytest.mark.parametrize("name", ["steady", "drifting", "contended"])
@pytest.mark.parametrize("effect", [0.75, 0.9, 1.0, 1.05])
def test_a_kept_speed_change_was_measured_faster(name: str, effect: float) -> None:
    for v in verdicts(name, effect, must_help=True):
        if not v.rollback:
            assert v.reason.startswith("it helped: ")
            assert v.evidence["ratio"] < 0.97 and v.evidence["p_value"] < 0.05
        else:
            assert v.reason.split(":")[0] in (
                "it hurt",
                "it stayed slower than 3 %",
                "it did not help (not significantly faster by more than 3 %)",
            )


@pytest.mark.parametrize(
    ("name", "effect", "at_least"),
    [
        ("steady", 1.15, 0.8),  # measured 0.88
        ("steady", 1.3, 0.97),  # 0.99
        ("steady", 1.5, 1.0),  # 1.00
        ("drifting", 1.3, 0.75),  # 0.82
        ("drifting", 1.5, 0.88),  # 0.93
        ("contended", 1.5, 0.75),  # 0.82
    ],
)
def test_a_harmful_change_is_rolled_back(name: str, effect: float, at_least: float) -> None:
    assert 1 - kept(name, effect) >= at_least


@pytest.mark.parametrize("name", ["steady", "drifting", "contended"])
def test_borderline_slowdowns_are_kept_far_less_often_than_by_significance_alone(
    name: str,
) -> None:
    for effect in (1.05, 1.08, 1.13, 1.15):
        now, before = kept(name, effect), kept_by_significance_alone(name, effect)
        assert now <= 0.8 * before, f"{name} ×{effect}: kept {now:.2f}, was {before:.2f}"
    shares = [kept(name, e) for e in (1.0, 1.05, 1.1, 1.15, 1.3)]
    assert shares == sorted(shares, reverse=True), "the slower, the less often kept"


@pytest.mark.parametrize("name", ["steady", "drifting", "contended"])
@pytest.mark.parametrize("effect", [0.75, 1.0, 1.03, 1.05, 1.08, 1.13, 1.15, 1.3])
def test_every_verdict_says_what_it_was_judged_on(name: str, effect: float) -> None:
    vs = verdicts(name, effect)
    for v in vs:
        ev = v.evidence
        assert ev["n_after"] in (VERIFY, 2 * VERIFY, 3 * VERIFY)
        # as many steps before as after, the newest VERIFY when the older ran at another level,
        # or the steps since a clear level shift among those (at least MIN_BASELINE)
        assert MIN_BASELINE <= ev["n_before"] <= max(ev["n_after"], VERIFY)
        assert ev["extended"] == (ev["n_after"] > VERIFY) and ev["settle_steps"] == SETTLE
        assert f"{int(ev['n_before'])} steps before, {int(ev['n_after'])} after" in v.reason
        assert f"p = {ev['p_value']:.2g}" in v.reason
        if not v.rollback:
            assert ev["ratio"] <= 1.03, "no kept change slower than 3 % by its median"
    if 1.03 <= effect <= 1.15:
        assert any(v.evidence["extended"] for v in vs), "borderline: some judged on more steps"
