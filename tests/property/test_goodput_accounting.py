"""The report's goodput accounting under hypothesis: whatever the steps, spans, collectives,
hangs and restarts (overlapping, out of order, outside the wall time), every rank's
categories sum to the job's wall time exactly, none is negative, and productive time never
exceeds the time steps ran."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.report.accounting import CATEGORIES, Spans, Steps, time_accounting
from perfloop.report.collectives import Collectives

FAST = settings(max_examples=80, deadline=None)
MS = 10**6


@st.composite
def jobs(draw: st.DrawFn) -> dict:
    ranks = draw(st.integers(1, 3))
    cols: dict[str, list] = {k: [] for k in ("rank", "step", "end_ns", "step_ms", "data_wait_ms")}
    coll: dict[str, list] = {k: [] for k in ("rank", "step", "start_ns", "duration_ms")}
    for r in range(ranks):
        t = draw(st.integers(0, 2000)) * MS
        n = draw(st.integers(0, 25))
        number = 0
        for _ in range(n):
            t += draw(st.integers(0, 300)) * MS  # a gap before the step
            ms = draw(st.floats(0.5, 800.0))
            t += int(ms * MS)
            number = draw(st.sampled_from([number + 1, number + 1, max(0, number - 3)]))
            cols["rank"].append(r)
            cols["step"].append(number)
            cols["end_ns"].append(t)
            cols["step_ms"].append(ms)
            cols["data_wait_ms"].append(draw(st.floats(0.0, 1000.0)))  # may exceed the step
            for _ in range(draw(st.integers(0, 2))):
                coll["rank"].append(r)
                coll["step"].append(number)
                coll["start_ns"].append(t - draw(st.integers(0, 900)) * MS)
                coll["duration_ms"].append(draw(st.floats(0.0, 400.0)))
    end = max(cols["end_ns"], default=0)
    spans = draw(
        st.lists(
            st.tuples(
                st.integers(0, ranks - 1),
                st.integers(-500, end // MS + 500),
                st.floats(0.0, 2000.0),
                st.sampled_from(["checkpoint", "eval", "forward"]),
            ),
            max_size=5,
        )
    )
    hangs = draw(st.lists(st.tuples(st.integers(0, end + 1), st.integers(0, end + 1)), max_size=2))
    starts = draw(st.lists(st.tuples(st.integers(0, ranks - 1), st.integers(0, end)), max_size=3))
    # the wall time may start after the first step or end before the last
    start = draw(st.integers(-(10**9), 500 * MS))
    stop = draw(st.integers(max(start, end - 1000 * MS), end + 2 * 10**9))
    return {
        "steps": Steps.of(**cols),
        "spans": Spans.of(
            rank=[s[0] for s in spans],
            start_ns=[s[1] * MS for s in spans],
            duration_ms=[s[2] for s in spans],
            phase=[s[3] for s in spans],
        ),
        "collectives": Collectives.of(**coll),
        "hangs": [(min(a, b), max(a, b)) for a, b in hangs],
        "starts": starts,
        "start_ns": start,
        "end_ns": stop,
        "warmup_steps": draw(st.integers(0, 4)),
    }


@FAST
@given(jobs())
def test_categories_sum_to_the_wall_time_exactly(job: dict) -> None:
    t = time_accounting(**job)
    assert set(t.rank_ns) == set(CATEGORIES)
    assert all(v >= 0 for v in t.rank_ns.values()), t.rank_ns
    assert sum(t.rank_ns.values()) == t.ranks * t.wall_ns
    assert t.wall_ns == job["end_ns"] - job["start_ns"]
    assert abs(sum(t.share(c) for c in CATEGORIES) - 1.0) < 1e-9 or t.wall_ns == 0
    steps: Steps = job["steps"]
    assert t.rank_ns["productive"] <= int(np.sum(np.round(steps.step_ms * MS))) + len(steps)
