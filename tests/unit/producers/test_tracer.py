"""The step/phase logic of the zero-code-change hooks (`Tracer`, pure Python): how calls into
a training loop's data loader, forward, backward, optimizer and collectives tile its steps."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest

from perfloop.producers.hooks import Tracer
from perfloop.producers.training import Recorder

MS = 1_000_000


def _tracer() -> Tracer:
    return Tracer(Recorder(None, wall_offset_ns=0, glue_ns=0))


def _train_iteration(tr: Tracer, t: int, *, bs: int = 8, opt: int = 1, step: bool = True) -> Any:
    """fetch 1 ms, forward 2 ms, loss 0.5 ms, backward 3 ms[, optimizer 1 ms] from ``t``."""
    tr.fetch(t, t + MS, batch_size=bs, tokens=bs * 16)
    assert tr.forward_begin(t + MS, training=True)
    tr.forward_end(t + 3 * MS)
    assert tr.backward_begin(t + 3_500_000)
    tr.backward_end(t + 6_500_000, loss=1.0)
    if not step:
        return None
    assert tr.optimizer_begin(t + 6_500_000, key=opt)
    return tr.optimizer_end(t + 7_500_000, key=opt, lr=0.01)


def _top_spans(rec: Recorder) -> dict[int, list[tuple[str, str, float]]]:
    out: dict[int, list[tuple[str, str, float]]] = defaultdict(list)
    for _, _, step, phase, name, ms, depth in rec._spans:
        if depth == 0:
            out[step].append((phase, name, round(ms, 6)))
    return out


def test_one_iteration_is_one_tiled_step() -> None:
    tr = _tracer()
    r0 = _train_iteration(tr, 0)
    r1 = _train_iteration(tr, 8 * MS)  # 0.5 ms of loop overhead before the fetch
    assert (r0.step, r0.step_time_ms, r1.step, r1.step_time_ms) == (0, 7.5, 1, 8.0)
    assert r1.phase_ms == {
        "other": 1.0,  # 0.5 ms before the fetch + 0.5 ms loss between forward and backward
        "data_wait": 1.0,
        "forward": 2.0,
        "backward": 3.0,
        "optimizer": 1.0,
    }
    assert (r1.fields["batch_size"], r1.fields["samples"], r1.fields["tokens"]) == (8, 8, 128)
    # loss and learning rate are read when the step is published (not in the hook)
    assert (r1.fields["loss"], r1.fields["lr"], r1.fields["grad_accum_steps"]) == ([1.0], [0.01], 1)


def test_gradient_accumulation_makes_one_step() -> None:
    tr = _tracer()
    for i in range(3):
        assert _train_iteration(tr, i * 7 * MS, bs=4, step=False) is None
    assert tr.optimizer_begin(21 * MS, key=1)
    rec = tr.optimizer_end(22 * MS, key=1)
    assert rec.step == 0 and rec.step_time_ms == 22.0
    assert rec.fields["grad_accum_steps"] == 3 and rec.fields["samples"] == 12
    assert rec.fields["batch_size"] == 4 and rec.fields["tokens"] == 3 * 64
    assert sum(ms for *_, ms in _top_spans(tr.rec)[0]) == pytest.approx(22.0)


def test_without_a_data_loader_the_forwards_inputs_count_the_samples() -> None:
    """No fetch fed the step: its training forwards' inputs give batch size, samples (summed
    over micro-batches) and tokens; a fetched step keeps the loader's figures."""
    tr = _tracer()
    for i in range(2):  # two micro-batches of 4, one optimizer step
        assert tr.forward_begin(i * 4 * MS, training=True)
        tr.forward_input(4, 4 * 32)
        tr.forward_end(i * 4 * MS + MS)
        assert tr.backward_begin(i * 4 * MS + MS)
        tr.backward_end(i * 4 * MS + 3 * MS, loss=1.0)
    tr.optimizer_begin(8 * MS, key=1)
    rec = tr.optimizer_end(9 * MS, key=1)
    assert (rec.fields["batch_size"], rec.fields["samples"], rec.fields["tokens"]) == (4, 8, 256)
    tr.fetch(9 * MS, 10 * MS, batch_size=8, tokens=0)  # images: the loader's figures stand
    assert tr.forward_begin(10 * MS, training=True)
    tr.forward_input(8, 0)
    tr.forward_end(11 * MS)
    tr.backward_begin(11 * MS)
    tr.backward_end(12 * MS, loss=1.0)
    tr.optimizer_begin(12 * MS, key=1)
    rec = tr.optimizer_end(13 * MS, key=1)
    assert (rec.fields["batch_size"], rec.fields["samples"], rec.fields["tokens"]) == (8, 8, 0)


def test_an_evaluation_loop_is_an_eval_span_not_steps() -> None:
    tr = _tracer()
    _train_iteration(tr, 0)  # step 0 ends at 7.5 ms
    t = 8 * MS
    for _ in range(3):  # eval: fetch 1 ms, forward under no_grad 1 ms
        tr.fetch(t, t + MS, batch_size=16)
        assert tr.forward_begin(t + MS, training=False)
        tr.forward_end(t + 2 * MS)
        t += 2 * MS
    tr.fetch(t, t + MS, stop=True)  # the eval loader is exhausted: still evaluation
    rec = _train_iteration(tr, 16 * MS)
    assert rec.step == 1 and rec.fields["samples"] == 8  # eval batches are not samples
    spans = _top_spans(tr.rec)[1]
    assert spans[:3] == [("user", "other", 0.5), ("eval", "eval", 7.0), ("user", "other", 1.0)]
    assert sum(ms for *_, ms in spans) == pytest.approx(rec.step_time_ms)


def _distill_iteration(tr: Tracer, t: int, *, teacher: bool = True) -> Any:
    """fetch 1 ms, [a frozen teacher's forward under no_grad 2 ms,] the student's forward
    2 ms, backward 3 ms, optimizer 1 ms from ``t`` (9 ms, or 7 without the teacher)."""
    tr.fetch(t, t + MS, batch_size=8)
    if teacher:
        assert tr.forward_begin(t + MS, training=False)
        tr.forward_end(t + 3 * MS)
        t += 2 * MS
    assert tr.forward_begin(t + MS, training=True)
    tr.forward_end(t + 3 * MS)
    assert tr.backward_begin(t + 3 * MS)
    tr.backward_end(t + 6 * MS, loss=1.0)
    assert tr.optimizer_begin(t + 6 * MS, key=1)
    return tr.optimizer_end(t + 7 * MS, key=1)


def test_a_no_grad_forward_in_every_step_is_training_not_evaluation() -> None:
    """Distillation: the teacher's forward under no_grad comes in every step, after the
    step's fetch. It is forward work of the step, and the fetch is training data."""
    tr = _tracer()
    for i in range(6):
        rec = _distill_iteration(tr, i * 9 * MS)
        assert rec.step == i and rec.step_time_ms == 9.0
        assert rec.phase_ms == {"data_wait": 1.0, "forward": 4.0, "backward": 3.0, "optimizer": 1.0}
        assert (rec.fields["samples"], rec.fields["batch_size"]) == (8, 8)


def test_a_lone_no_grad_forward_between_steps_is_still_an_evaluation() -> None:
    """A validation forward on data at hand (no loader) every few steps, after the first
    two: an eval span (its time aside), not forward work of the step it falls in."""
    tr = _tracer()
    t = 0
    for i in range(8):
        if i == 5:
            assert tr.forward_begin(t, training=False)  # 10 ms of validation
            tr.forward_end(t + 10 * MS)
            t += 10 * MS
        rec = _distill_iteration(tr, t, teacher=False)
        t += 7 * MS
        assert rec.phase_ms.get("eval", 0.0) == (10.0 if i == 5 else 0.0)
        assert rec.phase_ms["forward"] == 2.0 and rec.fields["samples"] == 8


def test_the_first_optimizer_ends_steps_and_another_takes_over_when_alone() -> None:
    tr = _tracer()
    t = 0
    ended = []
    for _ in range(2):  # a GAN: two optimizers per iteration → one step per iteration
        for opt in (1, 2):
            _train_iteration(tr, t, step=False)
            tr.optimizer_begin(t + 6_500_000, key=opt)
            ended.append(tr.optimizer_end(t + 7 * MS, key=opt) is not None)
            t += 7 * MS
    assert ended == [True, False, True, False]
    for _ in range(3):  # the script switched to optimizer 3: it ends steps from its 2nd step
        _train_iteration(tr, t, step=False)
        tr.optimizer_begin(t + 6_500_000, key=3)
        ended.append(tr.optimizer_end(t + 7 * MS, key=3) is not None)
        t += 7 * MS
    assert ended[4:] == [False, True, True]


def test_a_loop_without_an_optimizer_steps_at_each_training_forward_after_a_backward() -> None:
    tr = _tracer()
    assert tr.cycle_end(0) is None  # nothing yet
    _train_iteration(tr, 0, step=False)  # fetch, forward, backward to 6.5 ms
    tr.fetch(8 * MS, 9 * MS, batch_size=8)  # the update ran to 8 ms; the next batch
    rec = tr.cycle_end(9 * MS)  # the next training forward begins at 9 ms
    assert rec.step == 0 and rec.step_time_ms == 8.0  # ended where the next fetch began
    assert rec.phase_ms == {"data_wait": 1.0, "forward": 2.0, "other": 2.0, "backward": 3.0}
    assert rec.fields["grad_accum_steps"] == 1 and rec.fields["lr"] is None
    assert tr.forward_begin(9 * MS, training=True)  # the fetch is step 1's
    tr.forward_end(11 * MS)
    assert tr.cycle_end(12 * MS) is None  # a second forward before any backward: same step
    assert tr.backward_begin(12 * MS)
    tr.backward_end(14 * MS, loss=1.0)
    assert tr.forward_begin(15 * MS, training=False)  # an evaluation in between
    tr.forward_end(16 * MS)
    rec = tr.cycle_end(17 * MS)
    assert rec.step == 1 and rec.step_time_ms == 7.0  # 8 → 15 ms: up to the evaluation
    assert rec.fields["samples"] == 8
    assert sum(ms for *_, ms in _top_spans(tr.rec)[1]) == pytest.approx(7.0)
    tr.optimizer_begin(20 * MS, key=1)  # an optimizer after all: it ends steps from now on
    assert tr.optimizer_end(21 * MS, key=1) is not None
    _train_iteration(tr, 22 * MS, step=False)
    assert tr.cycle_end(30 * MS) is None


def test_nested_activity_and_collectives() -> None:
    tr = _tracer()
    tr.collective("broadcast", 0, MS, 64, "world", 2, "float32")  # before any step: row only
    assert not tr.rec.started and tr.rec._spans == []
    tr.fetch(MS, 2 * MS, batch_size=2)
    assert tr.forward_begin(2 * MS, training=True)
    tr.forward_end(3 * MS)
    assert tr.backward_begin(3 * MS)
    assert not tr.forward_begin(3_500_000, training=True)  # recomputation inside backward
    tr.collective("all_reduce", 4 * MS, 5 * MS, 1024, "world", 2, "float32")  # inside: depth 1
    tr.backward_end(6 * MS)
    tr.collective("all_reduce", 6 * MS, 7 * MS, 4, "world", 2, "float32")  # between: depth 0
    tr.optimizer_begin(7 * MS, key=1)
    rec = tr.optimizer_end(8 * MS, key=1)
    assert rec.phase_ms == {
        "data_wait": 1.0,
        "forward": 1.0,
        "backward": 3.0,
        "comm": 1.0,
        "optimizer": 1.0,
    }
    assert len(tr.rec._colls) == 3
    nested = [(p, d) for _, _, _, p, _, _, d in tr.rec._spans if d]
    assert nested == [("comm", 1)]


def test_point_to_point_comm_spans_are_named_after_their_op() -> None:
    """A pipeline stage's sends and receives: ``comm`` spans named ``send``/``recv``, which
    the stream tier tells apart from collectives (a pipeline's bubble is no exposed comm)."""
    tr = _tracer()
    tr.fetch(0, MS, batch_size=2)
    tr.collective("recv", MS, 2 * MS, 64, "world", 2, "float32")  # between activities
    assert tr.forward_begin(2 * MS, training=True)
    tr.forward_end(3 * MS)
    tr.collective("send", 3 * MS, 4 * MS, 64, "world", 2, "float32")
    assert tr.backward_begin(4 * MS)
    tr.collective("recv", 4 * MS, 5 * MS, 64, "world", 2, "float32")  # inside: depth 1
    tr.collective("all_reduce", 5 * MS, 6 * MS, 64, "world", 2, "float32")
    tr.backward_end(7 * MS)
    tr.optimizer_begin(7 * MS, key=1)
    assert tr.optimizer_end(8 * MS, key=1) is not None
    comm = [(name, depth) for _, _, _, phase, name, _, depth in tr.rec._spans if phase == "comm"]
    assert sorted(comm) == [("comm", 1), ("recv", 0), ("recv", 1), ("send", 0)]
