"""What the hooks see of communication, checkpoints, threads and long steps in a real process:
DDP's gradient all-reduce (a one-rank gloo group in this process), asynchronous collectives
timed to their completion, a comm hook of the script's own left in place, ``torch.save`` as a
checkpoint span, the script's own thread count, and progress reports of a step that goes on.
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from perfloop.producers import hooks
from perfloop.producers._comm import union
from perfloop.settings import ProducerSettings
from tests.unit.producers.test_hooks import FakePublisher


def _hooks_modules() -> list[Any]:
    """The modules of the hooks that read the clock (`_now`), each its own binding of it."""
    return [
        m
        for name, m in sorted(sys.modules.items())
        if name.startswith("perfloop.producers._hooks") and hasattr(m, "_now")
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def traced() -> Iterator[FakePublisher]:
    pub = FakePublisher()
    settings = ProducerSettings(job_id="comm-test", node="n0", stats_interval_s=3600, agent=False)
    assert hooks.install(settings, publisher=pub, command="pytest")
    try:
        yield pub
    finally:
        hooks.uninstall()


@pytest.fixture
def group(traced: FakePublisher) -> Iterator[None]:
    """A one-rank gloo process group, initialised after the hooks (as under `perfloop run`)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.Linear(256, 4),
    )


def _train(model: torch.nn.Module, steps: int, before_step: Any = None) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
        if before_step is not None:
            before_step(i)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _bucket_bytes(ddp: Any) -> int:
    return sum(p.numel() * p.element_size() for p in ddp.parameters())


def test_ddp_gradient_all_reduce_is_recorded_from_the_second_step(
    traced: FakePublisher, group: None
) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_model(), bucket_cap_mb=0.1)
    plain = DDP(_model(), bucket_cap_mb=0.1)  # the same model: what the stock reducer gives
    steps = 6
    torch.manual_seed(1)
    losses = _train(ddp, steps)
    assert getattr(ddp, "_perfloop_hooked", False), "the timing hook was added after step 0"
    hooks.uninstall()
    torch.manual_seed(1)
    assert _train(plain, steps) == pytest.approx(losses, rel=1e-6), "same gradients, same loss"

    colls = traced.rows("collective")
    assert colls["op"] and set(colls["op"]) == {"all_reduce"}
    assert set(colls["group"]) == {"world"} and set(colls["group_size"]) == {1}
    assert set(colls["dtype"]) == {"float32"}
    by_step: dict[int, int] = {}
    for step, size in zip(colls["step"], colls["size_bytes"], strict=True):
        by_step[step] = by_step.get(step, 0) + size
    # step 0 ran on the stock reducer (invisible); every later step reduced every gradient
    assert sorted(by_step) == list(range(1, steps))
    assert set(by_step.values()) == {_bucket_bytes(ddp)}
    assert len(colls["op"]) > steps - 1, "a 0.1 MB bucket cap makes several buckets a step"

    spans = traced.rows("span")
    comm = [
        (s, d, ms)
        for s, p, d, ms in zip(
            spans["step"], spans["phase"], spans["depth"], spans["duration_ms"], strict=True
        )
        if p == "comm"
    ]
    assert comm and all(d == 1 for _, d, _ in comm), "nested in the backward that waited"
    backward = {
        s: ms
        for s, p, d, ms in zip(
            spans["step"], spans["phase"], spans["depth"], spans["duration_ms"], strict=True
        )
        if p == "backward" and d == 0
    }
    for s in range(1, steps):
        nested = sum(ms for cs, _, ms in comm if cs == s)
        assert 0 < nested <= backward[s] * 1.01  # the union of overlapping buckets


def test_a_comm_hook_of_the_script_is_left_alone(traced: FakePublisher, group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    calls = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        calls.append(bucket.index())
        fut: Any = torch.futures.Future()
        fut.set_result(bucket.buffer())  # no communication at all
        return fut

    ddp = DDP(_model())
    ddp.register_comm_hook(None, counting_hook)
    _train(ddp, 4)
    assert not getattr(ddp, "_perfloop_hooked", False)
    assert len(calls) >= 4, "the script's hook ran every step"
    hooks.uninstall()
    assert not traced.rows("collective"), "the hook communicated nothing"


def test_no_timing_hook_when_the_setting_says_so(group: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    hooks._S.settings = hooks._S.settings.model_copy(update={"ddp_comm_hook": False})
    ddp = DDP(_model())
    _train(ddp, 3)
    assert not getattr(ddp, "_perfloop_hooked", False) and not ddp._comm_hooks
    assert not hooks._S.ddp.pending


def test_async_collectives_are_timed_to_completion(traced: FakePublisher, group: None) -> None:
    def every_step(i: int) -> None:
        work = dist.all_reduce(torch.ones(1000), async_op=True)
        work.wait()
        dist.all_reduce(torch.ones(10))  # synchronous

    _train(_model(), 4, every_step)
    hooks.uninstall()
    colls = traced.rows("collective")
    sizes = sorted(set(colls["size_bytes"]))
    assert sizes == [40, 4000]
    assert colls["op"].count("all_reduce") == 8


def test_a_step_whose_work_runs_in_an_optimizer_closure_has_its_phases(
    traced: FakePublisher,
) -> None:
    """``optimizer.step(closure)`` (PyTorch Lightning's automatic optimization, LBFGS): the
    forward and backward inside the closure are the step's, not the optimizer's."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = 5
    for _ in range(steps):
        x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    hooks.uninstall()
    rows = traced.rows("step")
    assert rows["step"] == list(range(steps))
    spans = traced.rows("span")
    for i in range(1, steps):
        phases = {
            p
            for s_, p, d in zip(spans["step"], spans["phase"], spans["depth"], strict=True)
            if s_ == i and d == 0
        }
        assert {"forward", "backward", "optimizer"} <= phases, phases
        top = sum(
            ms
            for s_, d, ms in zip(spans["step"], spans["depth"], spans["duration_ms"], strict=True)
            if s_ == i and d == 0
        )
        assert top == pytest.approx(rows["step_time_ms"][i], rel=1e-6), "spans tile the step"


def test_collectives_torch_added_lately_are_hooked_by_name(
    traced: FakePublisher, group: None
) -> None:
    """FSDP calls ``all_gather_single`` and ``reduce_scatter_single`` (torch 2.10+); sizes are
    the larger buffer, input or output."""

    def every_step(i: int) -> None:
        for name in ("all_gather_single", "reduce_scatter_single"):
            fn = getattr(dist, name, None)
            if fn is not None:
                fn(torch.empty(256), torch.ones(256))

    _train(_model(), 3, every_step)
    hooks.uninstall()
    colls = traced.rows("collective")
    expected = [
        op
        for name, op in (
            ("all_gather_single", "all_gather"),
            ("reduce_scatter_single", "reduce_scatter"),
        )
        if hasattr(dist, name)
    ]
    assert sorted(set(colls["op"])) == sorted(expected)
    assert set(colls["size_bytes"]) <= {1024}


def test_torch_save_is_a_checkpoint_span(traced: FakePublisher, tmp_path: Any) -> None:
    model = _model()

    def save_every_other(i: int) -> None:
        if i % 2 == 1:
            torch.save(model.state_dict(), tmp_path / f"ck{i}.pt")

    _train(model, 5, save_every_other)
    hooks.uninstall()
    spans = traced.rows("span")
    ck = [
        (s, d, name)
        for s, p, d, name in zip(
            spans["step"], spans["phase"], spans["depth"], spans["name"], strict=True
        )
        if p == "checkpoint"
    ]
    assert [s for s, _, _ in ck] == [1, 3] and {(d, n) for _, d, n in ck} == {(0, "torch.save")}
    assert (tmp_path / "ck3.pt").exists()


def test_the_scripts_own_thread_count_is_in_the_job_info(traced: FakePublisher) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _train(_model(), 2)
        hooks.uninstall()
    finally:
        torch.set_num_threads(before)
    info = traced.events("job_info")[-1]
    assert info.extra["torch.num_threads.by_script"] == "1"
    assert int(info.extra["cpu_budget"]) >= 1 and info.extra["cpu_budget_why"]


def test_a_step_that_goes_on_is_reported_with_where_the_rank_is(
    traced: FakePublisher, group: None
) -> None:
    held: dict[str, int] = {}

    def stall(i: int) -> None:
        if i == 5:
            sess = hooks.session()
            assert sess is not None
            sess.progress.min_ns = 200_000_000  # 0.2 s instead of 2 s
            sess.progress.every_ns = 200_000_000
            dist.barrier()
            time.sleep(2.0)  # in the training loop, outside any hooked call
            held["until"] = time.time_ns()

    _train(_model(), 7, stall)
    hooks.uninstall()
    # every 0.2 s while it lasts (a report made once the step went on says where it went)
    reports = [r for r in traced.events("progress") if r.ts_ns < held["until"]]
    assert reports and {(r.step, r.phase) for r in reports} == {(5, "other")}
    r = reports[0]
    assert r.step_start_ns <= r.since_ns < r.ts_ns


def test_a_rank_blocked_in_a_collective_reports_comm(traced: FakePublisher, group: None) -> None:
    """While the training thread is blocked in a synchronous collective (the state its hook
    sets around the call, held here for 2 s: a one-rank group never blocks), the report
    names the collective. Real blocked ranks: tests/integration/test_realworld.py."""
    blocked: dict[str, int] = {}

    def stuck_in_comm(i: int) -> None:
        if i == 4:
            sess = hooks.session()
            assert sess is not None
            sess.progress.min_ns = sess.progress.every_ns = 200_000_000
            t0 = time.perf_counter_ns()
            hooks._S.waiting = ("comm", "all_reduce", t0)  # what the collective hook sets
            time.sleep(2.0)
            hooks._S.waiting = None
            blocked["until"] = time.time_ns()

    _train(_model(), 6, stuck_in_comm)
    hooks.uninstall()
    reports = [r for r in traced.events("progress") if r.ts_ns < blocked["until"]]
    assert reports and {(r.phase, r.op) for r in reports} == {("comm", "all_reduce")}


def test_a_collective_completed_late_stays_in_the_step_it_was_called_in() -> None:
    """A bucket's completion noticed only in the next step (its done-callback ran on the
    backend's thread after the step ended) still counts in the step that called it."""
    from perfloop.producers._tracer import Tracer
    from perfloop.producers.training import Recorder

    rec = Recorder(None, wall_offset_ns=0)
    tr = Tracer(rec)
    ms = 1_000_000
    tr.fetch(0, ms, batch_size=8)
    assert tr.forward_begin(ms, training=True)
    tr.forward_end(2 * ms)
    assert tr.backward_begin(2 * ms)
    tr.async_done([("all_reduce", 3 * ms, 4 * ms, 4096, "world", 2, "float32", 0)])
    tr.backward_end(5 * ms)
    assert tr.optimizer_begin(5 * ms, key=1)
    assert tr.optimizer_end(6 * ms, key=1) is not None  # step 0 ends; step 1 is open
    tr.async_done([("all_reduce", 4 * ms, 5 * ms, 8192, "world", 2, "float32", 0)])
    steps = [row[2] for row in rec._colls]
    assert steps == [0, 0]
    nested = [(row[2], row[3]) for row in rec._spans if row[6] == 1]
    assert nested and {step for step, _ in nested} == {0}


@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 200)), max_size=30))
def test_union_covers_exactly_the_intervals(raw: list[tuple[int, int]]) -> None:
    intervals = [(a, a + d) for a, d in raw]
    out = union(intervals)
    covered = {t for a, b in intervals for t in range(a, b)}
    assert {t for a, b in out for t in range(a, b)} == covered
    assert all(a < b for a, b in out)
    assert all(out[i][1] < out[i + 1][0] for i in range(len(out) - 1)), "disjoint, not touching"


def test_functional_collectives_are_recorded_at_the_call(
    traced: FakePublisher, group: None
) -> None:
    """DTensor's tensor parallelism calls PyTorch's functional collectives, which issue the
    c10d ops without ``torch.distributed``'s functions: each call is a row (an all-gather
    sized by its output), none counted twice, and what it hands back is unchanged."""
    import torch.distributed._functional_collectives as funcol

    got: list[torch.Tensor] = []

    def every_step(i: int) -> None:
        t = torch.full((64,), float(i))
        got.append(funcol.all_reduce(t, "sum", dist.group.WORLD).wait())
        got.append(funcol.all_gather_single(t, 0, [0]))
        got.append(funcol.reduce_scatter_single(t, "sum", 0, dist.group.WORLD))

    _train(_model(), 3, every_step)
    hooks.uninstall()
    colls = traced.rows("collective")
    assert sorted(colls["op"]) == sorted(["all_gather", "all_reduce", "reduce_scatter"] * 3)
    assert set(colls["size_bytes"]) == {256}  # 64 float32; a one-rank gather: its input
    assert set(colls["group"]) == {"world"} and set(colls["group_size"]) == {1}
    assert all(
        torch.equal(torch.as_tensor(g), torch.full((64,), float(i // 3))) for i, g in enumerate(got)
    )


def test_a_functional_collective_lasts_its_call_and_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A functional collective's work is waited on where its tensor is first used: its row
    lasts the call plus that wait (here a wait made 20 ms long), not the 200 ms the script
    computed in between, also when what is first used is a view of it; the wait is a ``comm``
    span nested in the forward that used the tensor. A rank that arrives first waits longest,
    so this is what tells a tensor-parallel rank that waits from the one it waits for."""
    import torch.distributed._functional_collectives as funcol

    real_wait = funcol.wait_tensor

    def slow_wait(tensor: torch.Tensor) -> torch.Tensor:  # the other rank arrives 20 ms late
        time.sleep(0.02)
        return real_wait(tensor)

    monkeypatch.setattr(funcol, "wait_tensor", slow_wait)
    pub = FakePublisher()
    settings = ProducerSettings(job_id="funcol-wait", node="n0", stats_interval_s=3600, agent=False)
    assert hooks.install(settings, publisher=pub, command="pytest")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )

        class Parallel(torch.nn.Module):  # a row-wise layer's output, used in the next one
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                y = funcol.all_reduce(self.a(x), "sum", dist.group.WORLD)
                time.sleep(0.2)  # work that does not need the all-reduce
                return self.b(y.view(-1, 32))  # a view waits for the all-reduce too

        _train(Parallel(), 3)
        dist.destroy_process_group()
    finally:
        hooks.uninstall()
    colls = pub.rows("collective")
    assert colls["op"] == ["all_reduce"] * 3 and sorted(colls["step"]) == [0, 1, 2]
    assert all(20 <= ms < 200 for ms in colls["duration_ms"]), colls["duration_ms"]
    spans = pub.rows("span")
    waits = [
        ms
        for p, d, ms in zip(spans["phase"], spans["depth"], spans["duration_ms"], strict=True)
        if p == "comm" and d == 1 and ms >= 20
    ]
    assert len(waits) == 3, "each wait nested in the forward that used the tensor"


def test_a_functional_collective_on_another_thread_is_recorded_too(
    traced: FakePublisher, group: None
) -> None:
    """On a GPU, backward runs on autograd's device threads, and so do the functional
    collectives of tensor parallelism's backward: one called on another thread of the traced
    process (between the step's forward and backward here) is a row as well, in its step."""
    import threading

    import torch.distributed._functional_collectives as funcol

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        loss = model(torch.randn(16, 32)).sum()
        t = threading.Thread(
            target=lambda: funcol.all_reduce(torch.ones(32), "sum", dist.group.WORLD).wait()
        )
        t.start()
        t.join()
        loss.backward()
        opt.step()
        opt.zero_grad()
    hooks.uninstall()
    colls = traced.rows("collective")
    assert colls["op"] == ["all_reduce"] * 3
    assert colls["size_bytes"] == [128] * 3
    assert sorted(colls["step"]) == [0, 1, 2]
    assert traced.rows("step")["step"] == [0, 1, 2]  # the training thread is the traced one


def test_a_receive_without_a_future_is_timed_to_the_end_of_its_wait(
    traced: FakePublisher, group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gloo's send and receive works have no future: a pipeline stage posts a receive, then
    waits on its work (here the hooks' clock moves on by a second while it waits). The row
    lasts the posting plus the wait, and the wait is a ``recv`` span: the stage's bubble reads
    as time blocked in communication, not as time of its own. (No wall time is measured: the
    second is the clock's, set by the test.)"""
    waited_ms = 1000.0
    offset = [0]
    for mod in _hooks_modules():  # every hook reads the one clock, moved on alike
        monkeypatch.setattr(mod, "_now", lambda: time.perf_counter_ns() + offset[0])

    class Work:  # a gloo point-to-point work
        def get_future(self) -> Any:
            raise RuntimeError("no future for point-to-point works")

        def wait(self, timeout: Any = None) -> bool:
            offset[0] += int(waited_ms * 1e6)  # the peer's data comes a second later
            return True

    Work.wait = hooks._make_work_wait(Work.wait)  # as `install` wraps torch's Work.wait

    def irecv(
        tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0
    ) -> Work:
        return Work()

    irecv = hooks._make_collective(irecv, "recv")
    posted: list[Work] = []

    class Stage(torch.nn.Module):  # the last stage: its input comes from the previous one
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(32, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    def receive(i: int) -> None:
        work = irecv(torch.zeros(16, 32), src=0)
        posted.append(work)
        work.wait()

    _train(Stage(), 4, before_step=receive)
    unwaited = irecv(torch.zeros(4), src=0)  # posted and dropped: recorded at the posting
    _train(Stage(), 2)
    hooks.uninstall()
    assert len(posted) == 4 and unwaited is not None
    colls = traced.rows("collective")
    assert colls["op"] == ["recv"] * 5, colls
    with_wait = [ms >= waited_ms for ms in colls["duration_ms"]]
    assert sorted(with_wait) == [False, True, True, True, True], colls["duration_ms"]
    spans = traced.rows("span")
    recv = [
        (d, ms)
        for p, n, d, ms in zip(
            spans["phase"], spans["name"], spans["depth"], spans["duration_ms"], strict=True
        )
        if p == "comm" and n == "recv" and ms >= waited_ms
    ]
    # (the first wait came before the first step began: a row, no span, as for any op)
    assert len(recv) == 3 and {d for d, _ in recv} == {0}, recv
