"""WindowSet: when windows close, lateness, watermarks, what each batch kind yields, live
configuration, forgetting finished jobs and resuming from a snapshot."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

from perfloop.exceptions import ConfigError
from perfloop.schemas import decode_batch, encode_batch
from perfloop.schemas.codec import Batch
from perfloop.streams.windows import (
    COLUMNS,
    FIRST_GAP_MAX_S,
    NS,
    PANE_COLUMNS,
    WindowSet,
    WindowSpec,
    parse_specs,
    split_by_job,
)

T0 = 1_700_000_040 * NS  # a realistic epoch, a multiple of 3, 20 and 60 s (windows align)


def batch(kind: str, job: str = "j", node: str = "n0", **cols: Any) -> Batch:
    """A batch as the stream tier receives it: encoded and decoded by the real codec."""
    return decode_batch(encode_batch(kind, cols, job_id=job, node=node))


def steps(seconds: list[float], values: list[float], *, rank: int = 0, **kw: Any) -> Batch:
    ts = [T0 + int(s * NS) for s in seconds]
    n = len(ts)
    return batch("step", ts_ns=ts, rank=[rank] * n, step=list(range(n)), step_time_ms=values, **kw)


def rows(cols: dict[str, np.ndarray], **match: Any) -> list[dict[str, Any]]:
    """The rows of ``cols`` whose columns equal ``match``, as dicts, ordered by start."""
    out = []
    for i in range(len(cols["ts_ns"])):
        r = {k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()}
        if all(r[k] == v for k, v in match.items()):
            out.append(r)
    return sorted(out, key=lambda r: (r["window_s"], r["hop_s"], r["ts_ns"]))


def only_step_time(**kw: Any) -> WindowSet:
    return WindowSet(metrics={"step": "step_time_ms"}, **kw)


# -- specs ------------------------------------------------------------------------------------
def test_specs_parse_sizes_and_hops() -> None:
    specs = parse_specs("1, 10,60, 60/10")
    assert [(s.size_s, s.hop_s, s.tumbling) for s in specs] == [
        (1.0, 1.0, True),
        (10.0, 10.0, True),
        (60.0, 60.0, True),
        (60.0, 10.0, False),
    ]
    assert parse_specs(["10", WindowSpec(10)]) == (WindowSpec(10),), "duplicates collapse"


@pytest.mark.parametrize("bad", ["", "ten", "10/20", "0", "-5", "60/0", "1,x/2"])
def test_bad_specs_raise_config_errors_naming_the_value(bad: str) -> None:
    with pytest.raises(ConfigError, match="window"):
        parse_specs(bad)


def test_specs_must_be_whole_panes() -> None:
    with pytest.raises(ConfigError, match="multiples of the 1 s pane"):
        WindowSet("1.5")
    assert [str(s) for s in WindowSet("1.5,3/1.5", pane_s=0.5).specs] == ["1.5", "3/1.5"]


# -- closing ----------------------------------------------------------------------------------
def test_a_window_closes_once_the_watermark_minus_lateness_passes_its_end() -> None:
    ws = only_step_time(specs="10", lateness_s=2)
    ws.observe(steps([1, 2], [100, 110]), wall_ns=T0 + 3 * NS)
    assert len(ws.advance(T0 + 3 * NS)["ts_ns"]) == 0
    ws.observe(steps([11.5], [120]), wall_ns=T0 + 12 * NS)
    assert len(ws.advance(T0 + 12 * NS)["ts_ns"]) == 0, "watermark 11.5 - 2 < 10"
    ws.observe(steps([12], [130]), wall_ns=T0 + 12 * NS)
    (row,) = rows(ws.advance(T0 + 12 * NS))
    assert (row["ts_ns"], row["window_end_ns"], row["count"], row["mean"]) == (
        T0,
        T0 + 10 * NS,
        2,
        105.0,
    )
    assert row["rate_per_s"] == 0.2 and row["slope_per_s"] == 10.0
    assert len(ws.advance(T0 + 100 * NS)["ts_ns"]) == 1, "only the next window, once"
    assert len(ws.advance(T0 + 200 * NS)["ts_ns"]) == 0


def test_windows_close_on_time_with_no_new_events() -> None:
    ws = only_step_time(specs="10", lateness_s=2)
    ws.observe(steps([3], [1.0]), wall_ns=T0 + 4 * NS)  # received 1 s after its event time
    assert len(ws.advance(T0 + 12 * NS)["ts_ns"]) == 0  # watermark 3 + 8 idle = 11 < 12
    (row,) = rows(ws.advance(T0 + 13 * NS))  # 3 + 9 = 12 = end + lateness
    assert (row["ts_ns"], row["count"], row["closed_ns"]) == (T0, 1, T0 + 13 * NS)


def test_lateness_keeps_a_pane_open_for_stragglers_then_late_samples_are_counted() -> None:
    ws = only_step_time(specs="1", lateness_s=2)
    ws.observe(steps([0.5, 2.9], [1.0, 2.0]), wall_ns=T0 + 3 * NS)
    assert len(ws.advance(T0 + 3 * NS)["ts_ns"]) == 0, "watermark 2.9 - 2 < 1"
    ws.observe(steps([0.7], [3.0]), wall_ns=T0 + 3 * NS)  # within the allowed lateness
    ws.observe(steps([3.5], [4.0]), wall_ns=T0 + 4 * NS)
    (row,) = rows(ws.advance(T0 + 4 * NS))
    assert (row["ts_ns"], row["count"], row["mean"]) == (T0, 2, 2.0)
    assert ws.late_samples == 0
    ws.observe(steps([0.1, 0.2, 1.5], [9.0, 9.0, 5.0]), wall_ns=T0 + 4 * NS)
    assert ws.late_samples == 2, "the closed pane is not reopened"
    got = rows(ws.advance(T0 + 60 * NS))
    assert [(r["ts_ns"] - T0, r["count"]) for r in got] == [(NS, 1), (2 * NS, 1), (3 * NS, 1)]


def test_a_lagging_node_delays_its_jobs_windows_instead_of_losing_samples() -> None:
    ws = only_step_time(specs="1", lateness_s=1)
    ws.observe(steps([10, 30], [1, 1]), wall_ns=T0 + 31 * NS)  # n0, on time
    lag = steps([2], [7.0], rank=1)
    ws.observe(
        batch("step", node="n1", **{k: v.tolist() for k, v in lag.columns.items()}),
        wall_ns=T0 + 31 * NS,
    )
    out = ws.advance(T0 + 31 * NS)  # job watermark: min(30, 2) = 2
    assert [r["rank"] for r in rows(out)] == [], "panes wait for the lagging node"
    late = steps([2.5], [9.0], rank=1)
    ws.observe(
        batch("step", node="n1", **{k: v.tolist() for k, v in late.columns.items()}),
        wall_ns=T0 + 31 * NS,
    )
    assert ws.late_samples == 0
    out = ws.advance(T0 + 100 * NS)
    assert [(r["rank"], r["ts_ns"] - T0, r["mean"]) for r in rows(out, rank=1)] == [
        (1, 2 * NS, 8.0)
    ]


def test_a_kind_published_later_on_the_same_node_is_not_made_late() -> None:
    # The node sampler publishes GPU samples at once; the training process sends its steps of
    # the same seconds later: each kind of a node has its own watermark.
    ws = WindowSet("1", lateness_s=0, metrics={"gpu": "power_w", "step": "step_time_ms"})
    gpu = batch(
        "gpu",
        ts_ns=[T0 + k * NS for k in range(10)],
        rank=[0] * 10,
        device=[0] * 10,
        power_w=[300.0] * 10,
    )
    ws.observe(gpu, wall_ns=T0 + 10 * NS)
    ws.observe(steps([0.5], [100.0]), wall_ns=T0 + 10 * NS)
    assert len(ws.advance(T0 + 10 * NS)["ts_ns"]) == 0, "the step source holds the job at 0.5 s"
    ws.observe(steps([1.5, 8.5], [110.0, 120.0]), wall_ns=T0 + 10 * NS)
    out = rows(ws.advance(T0 + 10 * NS), metric="step_time_ms")
    assert ws.late_samples == 0
    assert [(r["ts_ns"] - T0) // NS for r in out] == [0, 1]


@pytest.mark.parametrize("grace_s", [0.0, 2.0])
def test_a_new_job_waits_new_job_grace_s_for_its_other_kinds(grace_s: float) -> None:
    # A job's GPU samples come first; its steps (of the same seconds) reach the worker 1.5 s
    # (wall) later, while the GPU source has gone quiet with its input read to the end.
    ws = WindowSet(
        "1",
        lateness_s=0,
        metrics={"gpu": "power_w", "step": "step_time_ms"},
        new_job_grace_s=grace_s,
    )
    gpu = batch(
        "gpu", ts_ns=[T0 + k * NS for k in range(10)], rank=[0] * 10, device=[0] * 10,
        power_w=[300.0] * 10,
    )  # fmt: skip
    ws.observe(gpu, wall_ns=T0 + 10 * NS)
    early = WindowSet()  # a worker restored in the job's first second keeps waiting
    early.restore(pickle.loads(pickle.dumps(ws.snapshot())))
    assert (early.watermark_ns("j", T0 + 11 * NS) == -1) is bool(grace_s)
    before = ws.advance(T0 + int(11.0 * NS))
    ws.observe(steps([0.5, 8.5], [100.0, 120.0]), wall_ns=T0 + int(11.5 * NS))
    after = ws.advance(T0 + 13 * NS)
    out = rows(after, metric="step_time_ms")
    if grace_s:  # nothing closed before the steps came: none is late
        assert len(before["ts_ns"]) == 0
        assert ws.late_samples == 0 and [(r["ts_ns"] - T0) // NS for r in out] == [0]
    else:  # the GPU source alone closed the job's first seconds: the steps there are late
        assert len(before["ts_ns"]) > 0
        assert ws.late_samples == 2 and out == []
    # then the steps (8.5 s) hold the job: their first message spanned 8 s of event time
    # (less than FIRST_GAP_MAX_S), so 1.5 s without the next is not silence yet; 10 s
    # without it is 2 s of silence
    assert FIRST_GAP_MAX_S > 8
    assert ws.watermark_ns("j", T0 + 13 * NS) == T0 + int(8.5 * NS)
    assert ws.watermark_ns("j", T0 + int(21.5 * NS)) == T0 + int(10.5 * NS)


def test_a_source_idle_past_source_idle_s_no_longer_holds_the_job_back() -> None:
    ws = only_step_time(specs="1", lateness_s=0, source_idle_s=5)
    ws.observe(steps([0.5], [1.0]), wall_ns=T0)  # n0 sends once; its clock lags by 100 s
    ws.observe(
        batch("step", node="n1", ts_ns=[T0 + 100 * NS], rank=[1], step=[0], step_time_ms=[5.0]),
        wall_ns=T0 + NS,
    )
    assert ws.watermark_ns("j", T0 + 2 * NS) == T0 + int(2.5 * NS), "n0: 0.5 s + 2 s idle"
    ws.observe(
        batch("step", node="n1", ts_ns=[T0 + 106 * NS], rank=[1], step=[1], step_time_ms=[5.0]),
        wall_ns=T0 + 6 * NS,
    )
    assert ws.watermark_ns("j", T0 + 6 * NS) == T0 + 106 * NS, "n0 idle > 5 s: only n1 counts"
    assert ws.watermark_ns("nope", T0) is None


# -- silence is real only on an input read to its end -------------------------------------------
def test_a_source_whose_input_has_more_to_read_is_not_silent() -> None:
    ws = only_step_time(specs="1", lateness_s=1)
    ws.set_channel("p0", caught_up=False, wall_ns=T0)
    ws.observe(steps([0.5, 4.5], [1.0, 2.0]), wall_ns=T0, channel="p0")
    assert ws.held_channels == ["p0"]
    assert ws.watermark_ns("j", T0 + 100 * NS) == T0 + int(4.5 * NS), "100 s of reading"
    assert [r["ts_ns"] for r in rows(ws.advance(T0 + 100 * NS))] == [T0], "only [0, 1) closed"
    ws.set_channel("p0", caught_up=True, wall_ns=T0 + 100 * NS)  # its silence counts from now
    # ... past the 4 s its one message spanned (the gap a producer batching so would leave)
    assert ws.watermark_ns("j", T0 + 104 * NS) == T0 + int(4.5 * NS)
    assert ws.watermark_ns("j", T0 + 106 * NS) == T0 + int(6.5 * NS)
    assert [r["ts_ns"] for r in rows(ws.advance(T0 + 106 * NS))] == [T0 + 4 * NS]
    assert ws.held_channels == [] and ws.late_samples == 0


def test_an_unsure_hold_keeps_the_silence_counted_before_it() -> None:
    """The reader could not look at its input for a while (its loop was blocked): its sources'
    silence is held, and once the input is known read to its end again it counts from when it
    first was, not from then; input left for real still restarts it."""
    ws = only_step_time(specs="1", lateness_s=1)
    ws.set_channel("p0", caught_up=True, wall_ns=T0)
    ws.observe(steps([0.5], [1.0]), wall_ns=T0, channel="p0")
    assert ws.watermark_ns("j", T0 + NS) == T0 + int(1.5 * NS)
    ws.set_channel("p0", caught_up=False, wall_ns=T0 + NS, unsure=True)
    assert ws.held_channels == ["p0"]
    assert ws.watermark_ns("j", T0 + 3 * NS) == T0 + NS // 2, "held: no silence counted"
    assert rows(ws.advance(T0 + 3 * NS)) == []
    ws.set_channel("p0", caught_up=True, wall_ns=T0 + 3 * NS)
    assert ws.watermark_ns("j", T0 + 3 * NS) == T0 + int(3.5 * NS), "3 s of silence, not 0"
    assert [r["ts_ns"] for r in rows(ws.advance(T0 + 3 * NS))] == [T0]
    # An unsure hold turned real (input left found meanwhile): the silence counts from then.
    ws.set_channel("p0", caught_up=False, wall_ns=T0 + 4 * NS, unsure=True)
    ws.set_channel("p0", caught_up=False, wall_ns=T0 + 4 * NS)
    ws.set_channel("p0", caught_up=False, wall_ns=T0 + 5 * NS, unsure=True)  # stays real
    ws.set_channel("p0", caught_up=True, wall_ns=T0 + 6 * NS)
    assert ws.watermark_ns("j", T0 + 6 * NS) == T0 + NS // 2
    assert ws.watermark_ns("j", T0 + 7 * NS) == T0 + int(1.5 * NS)
    assert ws.late_samples == 0


def test_a_source_waits_for_its_input_however_far_other_sources_read_on_it_got() -> None:
    ws = only_step_time(specs="1", lateness_s=0)
    ws.set_channel("p0", caught_up=False, wall_ns=T0)
    ws.observe(steps([0.5], [1.0]), wall_ns=T0, channel="p0")  # j's first batch
    k = batch("step", job="k", ts_ns=[T0 + 90 * NS], rank=[0], step=[0], step_time_ms=[1.0])
    ws.observe(k, wall_ns=T0, channel="p0")  # another job's, much newer, on the same input
    assert ws.watermark_ns("j", T0 + 50 * NS) == T0 + NS // 2
    ws.observe(steps([1.5], [1.0]), wall_ns=T0 + 50 * NS, channel="p0")  # j's next, behind k's
    ws.advance(T0 + 50 * NS)
    assert ws.late_samples == 0


def test_a_source_that_stopped_on_a_busy_input_stops_holding_its_job() -> None:
    """An input that always has more to read (the worker never reaches its end) still shows a
    source's silence: messages sent after the source's last one."""
    ws = only_step_time(specs="1", lateness_s=0, source_idle_s=5)
    ws.set_channel("p0", caught_up=False, wall_ns=T0)  # never caught up below
    sent = T0  # the producers' clock, as the messages' timestamps say
    ws.observe(steps([0.5], [1.0], rank=1, node="n1"), T0, "p0", sent_ns=sent)  # n1's last
    for i in range(1, 21):  # n0 goes on, a message a second, 2 s of event time each
        ws.observe(steps([2 * i + 0.5], [1.0]), T0 + i * NS, "p0", sent_ns=sent + i * NS)
        wm = ws.watermark_ns("j", T0 + i * NS)
        if i <= 5:  # n1 silent for up to 5 s of sent messages: it may still send, it holds j
            assert wm == T0 + NS // 2 + i * NS, i  # moved on only by that silence
        else:  # silent longer: j follows n0 alone
            assert wm == T0 + 2 * i * NS + NS // 2, i
    closed = rows(ws.advance(T0 + 20 * NS))
    assert [r["ts_ns"] for r in closed] == [T0 + k * NS for k in range(0, 40, 2)]
    assert ws.late_samples == 0 and ws.held_channels == ["p0"]


def test_without_send_times_a_source_on_a_busy_input_holds_its_job() -> None:
    ws = only_step_time(specs="1", lateness_s=0, source_idle_s=5)
    ws.set_channel("p0", caught_up=False, wall_ns=T0)
    ws.observe(steps([0.5], [1.0], rank=1, node="n1"), T0, "p0")
    for i in range(1, 21):
        ws.observe(steps([2 * i + 0.5], [1.0]), T0 + i * NS, "p0")
    assert ws.watermark_ns("j", T0 + 20 * NS) == T0 + NS // 2


def _every_3_s(ws: WindowSet, channel: str | None, other: bool) -> tuple[int, int]:
    """A source that sends a message every 3 s holding the 3 s of steps before it (10 a
    second), the windows advanced every 0.25 s; with ``other``, another job's messages keep
    its input busy (sent every 0.1 s, the input never read to its end). Returns the last
    message's wall time and the step samples the job's closed 1 s windows counted."""
    n = counted = 0
    wall = T0
    for k in range(1, 11):
        for q in range(12):  # the 3 s until this message, a tick every 0.25 s
            wall = T0 + (3 * (k - 1)) * NS + (q + 1) * NS // 4
            if other:
                for r in range(3):
                    t = wall - NS // 4 + r * NS // 10
                    o = batch("step", job="o", ts_ns=[t], rank=[0], step=[0], step_time_ms=[1.0])
                    ws.observe(o, t, channel, sent_ns=t)
            counted += sum(r["count"] for r in rows(ws.advance(wall), job_id="j"))
        secs = [3 * (k - 1) + i / 10 for i in range(30)]
        ws.observe(steps(secs, [1.0] * 30), wall, channel, sent_ns=wall)
        n += 30
    assert n == 300
    return wall, counted


@pytest.mark.parametrize("busy", [False, True], ids=["read to its end", "busy input"])
def test_a_source_silent_between_its_messages_as_usual_is_not_made_late(busy: bool) -> None:
    """Silence counts only past a source's usual gap between messages: a producer that sends
    every 3 s (more than the lateness) is not taken for silent in between."""
    ws = only_step_time(specs="1", lateness_s=1)
    if busy:
        ws.set_channel("p0", caught_up=False, wall_ns=T0)
    last, counted = _every_3_s(ws, "p0" if busy else None, other=busy)
    assert ws.late_samples == 0 and 200 < counted < 300  # windows closed along the way
    if busy:
        ws.set_channel("p0", caught_up=True, wall_ns=last)
    got = rows(ws.advance(last + 30 * NS), job_id="j")  # it stopped: it is silent now
    assert counted + sum(r["count"] for r in got) == 300 and ws.late_samples == 0


def test_a_source_that_stops_closes_its_windows_a_usual_gap_later() -> None:
    ws = only_step_time(specs="1", lateness_s=1)
    last, _ = _every_3_s(ws, None, other=False)
    end = T0 + 30 * NS  # the last pane [29, 30) s; its newest sample at 29.9 s
    # silence counts past the 3 s gap: closed once 29.9 + (idle - 3) - 1 >= 30
    assert not rows(ws.advance(last + int(4.0 * NS)), ts_ns=end - NS)
    (row,) = rows(ws.advance(last + int(4.2 * NS)), ts_ns=end - NS)
    assert row["count"] == 10


def test_a_job_waits_for_an_input_group_it_has_sent_nothing_on_yet() -> None:
    ws = WindowSet("1", lateness_s=0, input_skew_s=1, groups=("gpu", "step"))
    gpu = batch("gpu", ts_ns=[T0 + 30 * NS], rank=[0], device=[0], power_w=[300.0])
    ws.set_channel(("gpu", 0), caught_up=False, wall_ns=T0, group="gpu")
    ws.observe(gpu, wall_ns=T0, channel=("gpu", 0))
    # nothing read on the step topic yet: it starts about where the others were read
    assert ws.watermark_ns("j", T0) == T0 + 29 * NS
    ws.set_channel(("step", 1), caught_up=False, wall_ns=T0, group="step")
    k = batch("step", job="k", ts_ns=[T0 + 5 * NS], rank=[0], step=[0], step_time_ms=[1.0])
    ws.observe(k, wall_ns=T0, channel=("step", 1))
    assert ws.watermark_ns("j", T0) < T0, "j's first step batch may be on the step input"
    assert ws.watermark_ns("k", T0) < T0, "and k's first GPU batch on the GPU input"
    ws.set_channel(("step", 1), caught_up=True, wall_ns=T0, group="step")
    assert ws.watermark_ns("j", T0) == T0 + 30 * NS
    ws.set_channel(("gpu", 0), caught_up=True, wall_ns=T0, group="gpu")
    assert ws.watermark_ns("k", T0) == T0 + 5 * NS
    assert not ws.advance(T0)["count"].sum() and ws.late_samples == 0


def test_a_clocked_source_holds_its_job_at_its_clock() -> None:
    ws = only_step_time(specs="1", lateness_s=0)
    ws.observe(steps([0.5, 9.5], [1.0, 1.0]), wall_ns=T0 + 10 * NS)
    ws.clock_source("j", "n0", "derived", T0 + 2 * NS, wall_ns=T0 + 10 * NS)
    assert ws.watermark_ns("j", T0 + 10 * NS) == T0 + 2 * NS
    assert ws.watermark_ns("j", T0 + 10 * NS, derived=False) == T0 + int(9.5 * NS)
    ws.set_clock("j", "derived", T0 + 6 * NS)
    ws.set_clock("j", "derived", T0 + 3 * NS)  # a clock never goes back
    assert ws.watermark_ns("j", T0 + 10 * NS) == T0 + 6 * NS
    ws.add("j", "n0", 0, -1, np.array([T0 + 6 * NS]), "idle_ms", np.array([1.0]), T0 + 10 * NS)
    assert ws.late_samples == 0


def test_empty_windows_are_not_emitted_and_rows_carry_their_series() -> None:
    ws = WindowSet("1,10", lateness_s=0, metrics={"gpu": "power_w,temp_c"})
    b = batch(
        "gpu",
        node="n3",
        ts_ns=[T0, T0 + NS // 2, T0 + 5 * NS],
        rank=[4, 4, 4],
        device=[1, 1, 1],
        power_w=[300.0, 310.0, 320.0],
        temp_c=[60.0, 61.0, 62.0],
    )
    ws.observe(b, wall_ns=T0)
    out = ws.advance(T0 + 20 * NS)
    assert set(out) == set(COLUMNS)
    got = rows(out, metric="power_w")
    assert [(r["window_s"], r["ts_ns"] - T0, r["count"]) for r in got] == [
        (1.0, 0, 2),
        (1.0, 5 * NS, 1),
        (10.0, 0, 3),
    ], "the 1 s windows between the samples have no rows"
    assert {(r["job_id"], r["node"], r["rank"], r["device"]) for r in got} == {("j", "n3", 4, 1)}
    assert out["job_id"].dtype == object and out["count"].dtype == np.int64


# -- what each kind yields -------------------------------------------------------------------
# Richer than the lean defaults: every metric these tests read.
RICH = {
    "step": "step_time_ms,data_wait_ms,data_wait_share,tokens_per_s,samples_per_s",
    "span": "duration_ms,share",
    "collective": "duration_ms,busbw_gbps",
    "kernel": "busy_ms",
}


def test_step_batches_yield_times_shares_and_reported_throughput_only() -> None:
    ws = WindowSet("10", lateness_s=0, metrics=RICH)
    b = steps(
        [1, 2],
        [100.0, 200.0],
        data_wait_ms=[25.0, 100.0],
        tokens=[1000, 0],  # the second step did not report tokens
        samples=[8, 8],
        loss=[2.0, None],
    )
    ws.observe(b, wall_ns=T0 + 2 * NS)
    out = ws.advance(T0 + 12 * NS)
    by = {r["metric"]: r for r in rows(out)}
    assert by["data_wait_share"]["mean"] == pytest.approx(0.375)
    assert by["tokens_per_s"]["count"] == 1 and by["tokens_per_s"]["mean"] == 10_000.0
    assert by["samples_per_s"]["count"] == 2
    assert by["step_time_ms"]["device"] == -1
    assert "loss" not in by, "not a default metric"
    ws.configure("windows.metrics.step", "loss")
    ws.observe(steps([21, 22], [1.0, 1.0], loss=[3.0, None]), wall_ns=T0 + 22 * NS)
    # its messages came 20 s apart: silence counts past that (22 + 20 + 18 idle ≥ 30 + 10)
    (loss,) = rows(ws.advance(T0 + 60 * NS), metric="loss")
    assert loss["count"] == 1, "a null loss is not a sample"


def test_phase_shares_are_per_step_even_when_its_spans_arrive_in_two_batches() -> None:
    ws = WindowSet("10", lateness_s=1, metrics={**RICH, "gpu": ""})
    spans = [  # rank 0: step 0 from 1.0 s (data_wait 20, forward 30, backward 50 ms), step 1 after
        (1.00, 0, "data_wait", 20.0),
        (1.02, 0, "forward", 30.0),
        (1.05, 0, "backward", 50.0),
        (1.10, 1, "data_wait", 50.0),
        (1.15, 1, "forward", 50.0),
    ]

    def span_batch(part: list[tuple[float, int, str, float]]) -> Batch:
        return batch(
            "span",
            ts_ns=[T0 + int(s * NS) for s, *_ in part],
            rank=[0] * len(part),
            step=[p[1] for p in part],
            phase=[p[2] for p in part],
            name=[p[2] for p in part],
            duration_ms=[p[3] for p in part],
            depth=[0] * len(part),
        )

    ws.observe(span_batch(spans[:2]), wall_ns=T0 + 2 * NS)
    ws.observe(span_batch(spans[2:]), wall_ns=T0 + 2 * NS)
    nested = span_batch([(1.03, 0, "forward", 5.0)])
    nested.columns["depth"][:] = 1  # nested spans are not phases of the step
    ws.observe(nested, wall_ns=T0 + 2 * NS)
    out = rows(ws.advance(T0 + 30 * NS))
    share = {r["metric"]: (r["count"], r["mean"]) for r in out if r["metric"].endswith("_share")}
    assert share["phase.data_wait_share"] == (2, pytest.approx((0.2 + 0.5) / 2))
    assert share["phase.forward_share"] == (2, pytest.approx((0.3 + 0.5) / 2))
    assert share["phase.backward_share"] == (1, pytest.approx(0.5))
    ms = {r["metric"]: (r["count"], r["max"]) for r in out if r["metric"].endswith("_ms")}
    assert ms["phase.forward_ms"] == (2, 50.0)


def test_collectives_and_kernels_yield_per_op_times_bus_bandwidth_and_gpu_busy() -> None:
    ws = WindowSet("10", lateness_s=0, metrics=RICH)
    ws.observe(
        batch(
            "collective",
            ts_ns=[T0 + NS, T0 + 2 * NS],
            rank=[0, 0],
            step=[1, 2],
            op=["all_reduce", "my_custom_op"],
            size_bytes=[1_000_000_000, 10],
            group_size=[8, 8],
            duration_ms=[10.0, 1.0],
        ),
        wall_ns=T0,
    )
    ws.observe(
        batch(
            "kernel",
            ts_ns=[T0 + NS, T0 + NS],
            rank=[0, 0],
            step=[1, 1],
            stream=[-1, 7],
            kernel_class=["all", "gemm"],
            count=[10, 4],
            busy_ms=[80.0, 50.0],
        ),
        wall_ns=T0,
    )
    by = {r["metric"]: r for r in rows(ws.advance(T0 + 20 * NS))}
    assert by["comm.all_reduce_ms"]["mean"] == 10.0
    assert by["comm.all_reduce_busbw_gbps"]["mean"] == pytest.approx(100.0 * 2 * 7 / 8)
    assert "comm.other_ms" in by, "an unknown op counts as other"
    assert by["gpu_busy_ms"]["count"] == 1 and by["gpu_busy_ms"]["mean"] == 80.0


def test_derived_metrics_from_elsewhere_are_windowed_like_any_other() -> None:
    ws = WindowSet("10", lateness_s=0)
    ts = T0 + np.arange(5) * NS
    ws.add("j", "n0", np.array([0, 0, 1, 1, 1]), -1, ts, "idle_ms", np.arange(5.0), wall_ns=T0)
    got = rows(ws.advance(T0 + 20 * NS), metric="idle_ms")
    assert [(r["rank"], r["count"], r["mean"]) for r in got] == [(0, 2, 0.5), (1, 3, 3.0)]
    with pytest.raises(ValueError, match="times for"):
        ws.add("j", "n0", 0, -1, ts, "idle_ms", np.arange(3.0), wall_ns=T0)


def test_last_panes_hold_each_seconds_values_per_rank() -> None:
    ws = WindowSet("1,10", lateness_s=0, metrics={"step": "step_time_ms"})
    ws.observe(steps([0.1, 0.5, 0.9, 1.2], [5.0, 7.0, 6.0, 9.0]), wall_ns=T0)
    ws.advance(T0 + 3 * NS)
    p = ws.last_panes
    assert set(p) == set(PANE_COLUMNS)
    assert p["ts_ns"].tolist() == [T0, T0 + NS]
    assert p["last"].tolist() == [6.0, 9.0] and p["max"].tolist() == [7.0, 9.0]
    ws.advance(T0 + 4 * NS)
    assert len(ws.last_panes["ts_ns"]) == 0


def test_hopping_windows_match_a_brute_force_computation() -> None:
    rng = np.random.default_rng(7)
    t = np.sort(rng.uniform(0, 95, 400))
    v = rng.normal(50, 10, 400)
    ws = only_step_time(specs="60/10,7/3", lateness_s=0)
    out = []
    for part in np.array_split(np.arange(400), 9):
        wall = T0 + int(t[part].max() * NS)
        ws.observe(steps(t[part].tolist(), v[part].tolist()), wall_ns=wall)
        out.append(ws.advance(wall))
    out.append(ws.advance(T0 + 1000 * NS))
    cols = {k: np.concatenate([o[k] for o in out]) for k in COLUMNS}
    ts = T0 + (t * NS).astype(np.int64)
    for size, hop in ((60, 10), (7, 3)):
        got = {r["ts_ns"]: r for r in rows(cols, window_s=size, hop_s=hop)}
        expect = {}
        for k in range((T0 - size * NS) // (hop * NS), (T0 + 100 * NS) // (hop * NS) + 1):
            start = k * hop * NS  # windows start at multiples of their hop since the epoch
            inside = (ts >= start) & (ts < start + size * NS)
            if inside.any():
                expect[start] = (inside.sum(), v[inside].mean(), v[inside].min(), v[inside].max())
        assert sorted(got) == sorted(expect)
        for start, (n, mean, lo, hi) in expect.items():
            r = got[start]
            assert (r["count"], r["min"], r["max"]) == (n, lo, hi)
            assert r["mean"] == pytest.approx(mean, rel=1e-12)
            assert r["window_end_ns"] - r["ts_ns"] == size * NS


def test_tumbling_windows_taken_from_a_hopping_spec_equal_standalone_ones() -> None:
    rng = np.random.default_rng(3)
    t = np.sort(rng.uniform(0, 200, 300))
    v = rng.uniform(1, 100, 300)
    both, alone = only_step_time(specs="60,60/20", lateness_s=0), only_step_time(specs="60")
    for ws in (both, alone):
        ws.observe(steps(t.tolist(), v.tolist()), wall_ns=T0)
    a = rows(both.advance(T0 + 999 * NS), window_s=60.0, hop_s=60.0)
    b = rows(alone.advance(T0 + 999 * NS), window_s=60.0, hop_s=60.0)
    assert len(a) == 4
    for ra, rb in zip(a, b, strict=True):  # merged in another order: the slope may differ by ulps
        assert ra.pop("slope_per_s") == pytest.approx(rb.pop("slope_per_s"), rel=1e-9)
        assert ra == rb


def test_tick_gives_one_column_set_per_job() -> None:
    ws = only_step_time(specs="10", lateness_s=0)
    for job in ("b", "a", "b2"):
        s = steps([1, 2], [1.0, 2.0])
        ws.observe(
            batch("step", job=job, **{k: v.tolist() for k, v in s.columns.items()}), wall_ns=T0
        )
    per_job = ws.tick(T0 + 20 * NS)
    assert sorted(c["job_id"].tolist() for c in per_job) == [["a"], ["b"], ["b2"]]
    assert split_by_job(ws.advance(T0 + 30 * NS)) == {}


# -- configuration ----------------------------------------------------------------------------
def test_configure_returns_old_and_new_and_rejects_unknown_keys_and_values() -> None:
    ws = WindowSet()
    assert ws.configure("windows.specs", "10,60/30") == ("1,10,60,60/10", "10,60/30")
    assert ws.configure("windows.lateness_s", "0.5") == (2.0, 0.5)
    assert ws.configure("windows.metrics.gpu", ["power_w", "temp_c"])[1] == "power_w,temp_c"
    with pytest.raises(ConfigError, match=r"valid: windows.specs, windows.lateness_s"):
        ws.configure("windows.size", 10)
    with pytest.raises(ConfigError, match=r"unknown gpu metrics \['watts'\]; valid: sm_util_pct"):
        ws.configure("windows.metrics.gpu", "watts")
    with pytest.raises(ConfigError, match="unknown batch kind 'disk'"):
        ws.configure("windows.metrics.disk", "x")
    with pytest.raises(ConfigError, match="lateness_s must be a number of seconds >= 0"):
        ws.configure("windows.lateness_s", -1)
    assert ws.lateness_s == 0.5 and [str(s) for s in ws.specs] == ["10", "60/30"]


def test_a_new_spec_starts_clean_while_unchanged_specs_continue() -> None:
    ws = only_step_time(specs="10", lateness_s=0)
    ws.observe(steps([1, 5, 12], [1.0, 2.0, 3.0]), wall_ns=T0 + 12 * NS)
    ws.advance(T0 + 12 * NS)  # closes [0, 10); closed until 12 s
    ws.configure("windows.specs", "10,20/10")
    ws.observe(steps([13, 25, 31], [4.0, 5.0, 6.0]), wall_ns=T0 + 31 * NS)
    got = rows(ws.advance(T0 + 200 * NS))
    ten = [(r["ts_ns"] - T0) // NS for r in got if r["window_s"] == 10]
    twenty = [(r["ts_ns"] - T0) // NS for r in got if r["window_s"] == 20]
    assert ten == [10, 20, 30], "the 10 s windows go on"
    assert twenty == [20, 30], "no 20 s window that began before the change ([0, 20), [10, 30))"


def test_a_metric_added_live_starts_with_its_next_window() -> None:
    ws = WindowSet("10", lateness_s=0, metrics={"step": "step_time_ms"})
    ws.observe(steps([1, 2, 8], [1.0, 2.0, 3.0], data_wait_ms=[0.5, 0.5, 0.5]), wall_ns=T0 + 8 * NS)
    ws.advance(T0 + 8 * NS)  # closed until 8 s: [0, 10) is open
    ws.configure("windows.metrics.step", "step_time_ms,data_wait_ms")
    ws.observe(steps([15], [4.0], data_wait_ms=[1.0]), wall_ns=T0 + 15 * NS)
    got = rows(ws.advance(T0 + 100 * NS), metric="data_wait_ms")
    assert [(r["ts_ns"] - T0) // NS for r in got] == [10], (
        "its partial window [0, 10) is not emitted"
    )


# -- memory and restarts ----------------------------------------------------------------------
def test_sources_silent_for_forget_after_s_are_forgotten_and_their_ids_reused() -> None:
    ws = WindowSet("1,10", lateness_s=0, forget_after_s=60)
    ws.observe(steps([1, 2], [1.0, 2.0], data_wait_ms=[0.1, 0.1]), wall_ns=T0 + 2 * NS)
    ws.advance(T0 + 20 * NS)
    series = ws.series
    assert series > 0 and ws.closed_until_ns("j") is not None
    ws.advance(T0 + 61 * NS)
    assert ws.series == series, "silent for 59 s: kept"
    ws.advance(T0 + 63 * NS)
    assert ws.series == 0 and ws.closed_until_ns("j") is None
    again = steps([100, 101], [5.0, 6.0], data_wait_ms=[0.1, 0.1])
    ws.observe(
        batch("step", job="k", **{k: v.tolist() for k, v in again.columns.items()}),
        wall_ns=T0 + 101 * NS,
    )
    got = rows(ws.advance(T0 + 120 * NS), metric="step_time_ms", window_s=10.0)
    assert [(r["job_id"], r["count"]) for r in got] == [("k", 2)]
    assert ws.series == series, "ids are reused: state stays bounded"


def _stream(seed: int) -> list[tuple[Batch, int]]:
    """Mixed batches of two nodes, in arrival order, with their wall times."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(40):
        lo = T0 + i * NS // 2
        node = f"n{i % 2}"
        ts = np.sort(rng.integers(lo, lo + NS // 2, 12)).tolist()
        gpu = batch(
            "gpu",
            node=node,
            ts_ns=ts,
            rank=[i % 2] * 12,
            device=rng.integers(0, 2, 12).tolist(),
            sm_util_pct=rng.uniform(0, 100, 12).round(2).tolist(),
        )
        out.append((gpu, lo + NS // 2 + NS // 5))
        k = rng.integers(1, 4)
        sp = batch(
            "span",
            node=node,
            ts_ns=ts[:k],
            rank=[i % 2] * k,
            step=[i // 2] * k,
            phase=["forward"] * k,
            name=["forward"] * k,
            duration_ms=rng.uniform(1, 9, k).tolist(),
        )
        out.append((sp, lo + NS // 2 + NS // 5))
    return out


def test_a_restored_snapshot_produces_exactly_the_windows_of_an_uninterrupted_run() -> None:
    feed = _stream(5)
    ref, first = WindowSet(lateness_s=1), WindowSet(lateness_s=1)
    resumed = WindowSet("10", lateness_s=9)  # settings come from the snapshot
    expect, got = [], []
    for i, (b, wall) in enumerate(feed):
        ref.observe(b, wall)
        expect.append(ref.advance(wall))
        if i == 31:
            continue
        target = first if i < 31 else resumed
        target.observe(b, wall)
        got.append(target.advance(wall))
        if i == 30:  # snapshot mid-stream, open panes and held spans included; restart
            resumed.restore(pickle.loads(pickle.dumps(first.snapshot())))
            resumed.observe(*feed[31])
            got.append(resumed.advance(feed[31][1]))
    expect.append(ref.advance(T0 + 999 * NS))
    got.append(resumed.advance(T0 + 999 * NS))

    def flat(cs: list[dict[str, np.ndarray]]) -> list[tuple[Any, ...]]:
        return [tuple(r.values()) for c in cs for r in rows(c)]

    assert len(flat(expect)) > 100
    assert flat(got) == flat(expect)
    assert resumed.late_samples == ref.late_samples


def test_restore_rejects_a_snapshot_of_another_version() -> None:
    with pytest.raises(ConfigError, match="snapshot version"):
        WindowSet().restore({"version": 99})


def test_many_finished_jobs_leave_bounded_state() -> None:
    ws = WindowSet("1", lateness_s=0, forget_after_s=10, metrics={"step": "step_time_ms"})
    for j in range(30):
        t = 100 * j
        ranks = [0, 1000 + 100 * j]  # far-apart ranks: each job's lookup segment is large
        ws.observe(
            batch(
                "step",
                job=f"job{j}",
                ts_ns=[T0 + t * NS] * 2,
                rank=ranks,
                step=[0, 0],
                step_time_ms=[1.0, 2.0],
            ),
            wall_ns=T0 + t * NS,
        )
        out = ws.advance(T0 + (t + 2) * NS)
        assert out["job_id"].tolist() == [f"job{j}"] * 2 and sorted(out["rank"].tolist()) == ranks
        assert ws.series == 2 and ws._reg.n_sids == 2, "ids of forgotten series are reused"
        ws.advance(T0 + (t + 90) * NS)  # silent for long: forgotten
        assert ws.series == 0 and ws.closed_until_ns(f"job{j}") is None
        assert ws._reg.n_glut <= 4096, "dead lookup segments are compacted away"


def test_a_restored_set_reads_its_waiting_batches_after_a_metric_is_added() -> None:
    ws = WindowSet("1", lateness_s=5, metrics={"gpu": "power_w"})
    g = batch("gpu", ts_ns=[T0 + NS], rank=[0], device=[0], power_w=[300.0], temp_c=[70.0])
    ws.observe(g, wall_ns=T0 + NS)  # waits: its pane closes at 1 + 1 + 5 s
    resumed = WindowSet()
    resumed.restore(pickle.loads(pickle.dumps(ws.snapshot())))
    resumed.configure("windows.metrics.gpu", "power_w,temp_c")
    got = rows(resumed.advance(T0 + 30 * NS))
    assert [(r["metric"], r["mean"]) for r in got] == [("power_w", 300.0)]


def test_a_producer_clock_that_steps_back_does_not_make_silence_count_early() -> None:
    ws = only_step_time(specs="1", lateness_s=0)
    ws.observe(steps([0.5], [1.0]), T0 + NS, sent_ns=T0 + 20 * NS)
    ws.observe(steps([1.5], [1.0]), T0 + 2 * NS, sent_ns=T0 + 10 * NS)  # its clock went back
    # a gap of 0, not -10 s: silent 3 s after its last message, the source is at 1.5 + 3
    assert ws.watermark_ns("j", T0 + 5 * NS) == T0 + int(4.5 * NS)


def test_a_first_message_of_history_does_not_make_its_job_wait_as_long_as_it_spans() -> None:
    """30 s of history in one message (a backfill, a replay): its gap is guessed at
    FIRST_GAP_MAX_S, not 30 s, so its last windows close that long after it, not 30 s later."""
    ws = only_step_time(specs="10", lateness_s=1)
    arrived = T0 + 31 * NS
    ws.observe(steps([k / 10 for k in range(300)], [1.0] * 300), wall_ns=arrived)
    early = rows(ws.advance(arrived), job_id="j")
    assert [(r["ts_ns"] - T0) // NS for r in early] == [0, 10]  # by the data alone
    # the last pane [20, 30) s: closed once 29.9 + (idle - FIRST_GAP_MAX_S) - 1 >= 30
    wait_s = FIRST_GAP_MAX_S + 1.1
    assert not rows(ws.advance(arrived + int((wait_s - 0.1) * NS)), job_id="j")
    (last,) = rows(ws.advance(arrived + int((wait_s + 0.1) * NS)), job_id="j")
    assert (last["ts_ns"] - T0) // NS == 20 and last["count"] == 100 and ws.late_samples == 0
