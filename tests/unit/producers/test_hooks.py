"""The zero-code-change hooks: the torch layer on a real CPU training loop (in process, a fake
publisher) and the run bootstrap (subprocesses). The step/phase logic: test_tracer.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfloop.producers import _hooks_loader, hooks
from perfloop.producers.launch import BOOTSTRAP_DIR, child_env
from perfloop.schemas import decode_batch, decode_event, is_batch
from perfloop.settings import ProducerSettings

# -- the torch layer -----------------------------------------------------------------------
torch = pytest.importorskip("torch")


class FakePublisher:
    def __init__(self) -> None:
        self.messages: list[bytes] = []

    def publish(self, topic: str, key: str, value: bytes) -> bool:
        self.messages.append(value)
        return True

    def rows(self, kind: str) -> dict[str, list[Any]]:
        cols: dict[str, list[Any]] = defaultdict(list)
        for v in self.messages:
            if is_batch(v) and (b := decode_batch(v)).kind == kind:
                for c, a in b.columns.items():
                    cols[c].extend(a.tolist())
        return cols

    def events(self, kind: str) -> list[Any]:
        events = [decode_event(v) for v in self.messages if not is_batch(v)]
        return [e for e in events if kind == e.KIND]


@pytest.fixture
def installed() -> Iterator[FakePublisher]:
    pub = FakePublisher()
    settings = ProducerSettings(job_id="hooks-test", node="n0", stats_interval_s=3600, agent=False)
    assert hooks.install(settings, publisher=pub, command="pytest")
    try:
        yield pub
    finally:
        hooks.uninstall()
    assert not hooks.installed()


def _loop(epochs: int = 2, n: int = 48, bs: int = 8, workers: int = 0) -> int:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(n, 6), torch.randint(0, 3, (n,)))
    loader = torch.utils.data.DataLoader(data, batch_size=bs, num_workers=workers)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss()
    steps = 0
    for _ in range(epochs):
        for x, y in loader:
            opt.zero_grad()
            crit(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            steps += 1
        with torch.no_grad():
            for x, _ in loader:
                model(x)
    return steps


def test_a_real_loop_publishes_its_steps_tiled(installed: FakePublisher) -> None:
    steps = _loop()
    hooks.uninstall()  # closes the session: everything is handed over
    rows = installed.rows("step")
    assert rows["step"] == list(range(steps))
    assert set(rows["batch_size"]) == {8} and set(rows["epoch"]) == {0, 1}
    assert all(v == v for v in rows["grad_norm"]) and set(rows["lr"]) == {0.1}
    spans = installed.rows("span")
    for i, ms in enumerate(rows["step_time_ms"]):
        top = [
            d
            for s, d, depth in zip(spans["step"], spans["duration_ms"], spans["depth"], strict=True)
            if s == i and depth == 0
        ]
        assert sum(top) == pytest.approx(ms, rel=1e-6)
    evals = [s for s, p in zip(spans["step"], spans["phase"], strict=True) if p == "eval"]
    assert evals == [steps // 2, steps]  # after each epoch; the last in the unfinished step
    (info,) = installed.events("job_info")
    assert (info.model_name, info.optimizer, info.model_params) == ("Sequential", "SGD", 163)
    assert [e.state for e in installed.events("lifecycle")] == ["started", "finished"]


@pytest.mark.parametrize("how", ["autograd.grad", "backward"])
def test_a_loop_that_updates_its_parameters_itself_has_a_step_per_iteration(
    installed: FakePublisher, how: str
) -> None:
    """No optimizer: ``torch.autograd.grad`` (or ``backward``) and an update of its own; each
    forward-backward cycle is a step (the last one unfinished), across discovery's end."""
    import gc

    gc.collect()  # no optimizer of another test left in this process
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 6), torch.randint(0, 3, (48,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    params = list(model.parameters())
    iterations = 0
    for _ in range(2):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            if how == "backward":
                loss.backward()
                grads = [p.grad for p in params]
            else:
                grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p -= 0.1 * g
                    p.grad = None
            iterations += 1
    hooks.uninstall()
    rows = installed.rows("step")
    assert rows["step"] == list(range(iterations - 1))
    assert set(rows["batch_size"]) == {8} and set(rows["grad_accum_steps"]) == {1}
    spans = installed.rows("span")
    for phase in ("forward", "backward"):
        assert spans["phase"].count(phase) == iterations
    for i, ms in enumerate(rows["step_time_ms"]):
        top = [
            d
            for s, d, depth in zip(spans["step"], spans["duration_ms"], spans["depth"], strict=True)
            if s == i and depth == 0
        ]
        assert sum(top) == pytest.approx(ms, rel=1e-6)


def test_a_loop_that_slices_its_own_tensors_has_samples_and_tokens(
    installed: FakePublisher,
) -> None:
    """A language-model loop without a DataLoader (token ids sliced from one tensor, as
    many small GPT trainers do): every step has the batch's samples and tokens; neither the
    loss module's call nor the evaluation's forwards (no grad) count again."""
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (64, 12))
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8), torch.nn.Flatten(), torch.nn.Linear(96, 50)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss()  # a module called at the top level, as the model is
    steps = 10
    for i in range(steps):
        x = ids[(i % 4) * 16 : (i % 4) * 16 + 16]
        opt.zero_grad()
        crit(model(x), x[:, 0]).backward()
        opt.step()
        if i == 4:
            with torch.no_grad():
                model(ids[:32])
    hooks.uninstall()
    rows = installed.rows("step")
    assert rows["step"] == list(range(steps))
    assert set(rows["batch_size"]) == {16} and set(rows["samples"]) == {16}
    assert set(rows["tokens"]) == {16 * 12}


def test_a_distillation_loop_counts_its_data_and_its_teacher(installed: FakePublisher) -> None:
    """A frozen teacher in eval mode under no_grad, a student trained on its outputs: every
    step has its data wait and samples, and no evaluation (what an input-bound job's
    diagnosis reads)."""
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 6), torch.randint(0, 3, (96,)))
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    teacher = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    teacher.eval()
    student = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    steps = 0
    for x, y in loader:
        with torch.no_grad():
            soft = teacher(x).softmax(-1)
        out = student(x)
        loss = torch.nn.functional.cross_entropy(out, y) + (out.softmax(-1) - soft).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
    hooks.uninstall()
    rows = installed.rows("step")
    assert rows["step"] == list(range(steps))
    assert set(rows["samples"]) == {8} and set(rows["batch_size"]) == {8}
    spans = installed.rows("span")
    assert "eval" not in spans["phase"]
    waits = {s for s, p in zip(spans["step"], spans["phase"], strict=True) if p == "data_wait"}
    assert waits == set(range(steps)) | {steps}  # and the exhausted loader's, after the last


def test_a_gradient_penalty_is_timed_but_not_a_backward_pass(installed: FakePublisher) -> None:
    """WGAN-GP: ``torch.autograd.grad(..., create_graph=True)`` for a penalty, then the
    step's backward: one backward pass and one loss a step, both spans timed."""
    critic = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-3)
    for _ in range(4):
        x = torch.randn(8, 6, requires_grad=True)
        (g,) = torch.autograd.grad(critic(x).sum(), x, create_graph=True)
        loss = critic(torch.randn(8, 6)).mean() + (g.norm(dim=1) - 1).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    hooks.uninstall()
    rows = installed.rows("step")
    assert rows["step"] == [0, 1, 2, 3] and set(rows["grad_accum_steps"]) == {1}
    assert installed.rows("span")["phase"].count("backward") == 8


def test_a_step_the_grad_scaler_skips_is_still_a_step(installed: FakePublisher) -> None:
    """Mixed precision: ``GradScaler.step`` skips the optimizer when gradients are inf; the
    iteration is a step of its own all the same (the others are unchanged)."""
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped = []
    for i in range(6):
        loss = model(torch.randn(4, 6)).pow(2).sum()
        if i in (1, 4):
            loss = loss * float("inf")  # an overflow: the scaler skips this step
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < scale)  # it backs off after a skip
        opt.zero_grad()
    hooks.uninstall()
    assert skipped == [False, True, False, False, True, False]
    rows = installed.rows("step")
    assert rows["step"] == list(range(6)) and set(rows["grad_accum_steps"]) == {1}
    spans = installed.rows("span")
    assert spans["phase"].count("optimizer") == 6  # one span a step, nested steps not apart


def test_gradient_accumulation_with_an_optimizer_stays_one_step(installed: FakePublisher) -> None:
    model = torch.nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(12):
        model(torch.randn(4, 6)).sum().backward()
        if i % 4 == 3:
            opt.step()
            opt.zero_grad()
    hooks.uninstall()
    rows = installed.rows("step")
    assert rows["step"] == [0, 1, 2] and set(rows["grad_accum_steps"]) == {4}


def test_after_discovery_only_root_modules_carry_hooks(installed: FakePublisher) -> None:
    from torch.nn.modules import module as mm

    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    crit = torch.nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        crit(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
        opt.step()
    assert not hooks._S.discovering
    assert not mm._global_forward_pre_hooks and not mm._global_forward_hooks
    roots = {type(m).__name__ for m in hooks._S.roots}
    assert roots == {"Sequential", "CrossEntropyLoss"}  # not Linear or ReLU


def _mlp() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


class _Mlp(torch.nn.Module):
    """`_mlp` with a forward of its own (torch.compile traces a container's `forward` as
    part of the nn library: `Module.compile()` on a bare `Sequential` makes no graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("part", ["model", "submodule", "in_place", "function"])
def test_compiled_code_keeps_its_graph(part: str, recwarn: pytest.WarningsRecorder) -> None:
    """Code under ``torch.compile`` (a model, a submodule of a model that is not compiled,
    ``Module.compile()`` in place, a compiled function that calls the model): the hooks never
    break its graph nor make it compile again, through discovery and what would be a
    rediscovery, and every step is timed (a compiled model's forward by its own hooks, a
    model compiled in place or called inside a compiled function by nothing: no forward span
    from inside a graph). torch's warning to whoever adds global module hooks is not shown:
    perfloop's hooks expect what it warns of."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    pub = FakePublisher()
    settings = ProducerSettings(job_id="compiled", node="n0", stats_interval_s=3600, agent=False)
    torch._dynamo.reset()
    counters.clear()
    assert hooks.install(settings, publisher=pub, command="pytest", rediscover_every=5)
    try:
        torch.manual_seed(0)
        model = _Mlp() if part == "in_place" else _mlp()
        loss_of: Any = lambda x, y: torch.nn.functional.cross_entropy(model(x), y)  # noqa: E731
        if part == "model":
            compiled = torch.compile(model, backend="eager")
            loss_of = lambda x, y: torch.nn.functional.cross_entropy(compiled(x), y)  # noqa: E731
        elif part == "submodule":
            model[0] = torch.compile(model[0], backend="eager")  # type: ignore[assignment]
        elif part == "in_place":
            model.compile(backend="eager")
        else:
            loss_of = torch.compile(loss_of, backend="eager")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(12):  # discovery in steps 0-1; a rediscovery would come at 5 and 10
            loss_of(torch.randn(8, 6), torch.randint(0, 3, (8,))).backward()
            opt.step()
            opt.zero_grad()
        assert hooks._S.compiled and not hooks._S.global_handles
    finally:
        hooks.uninstall()
        torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    assert not [w for w in recwarn if "global hooks" in str(w.message)]
    assert pub.rows("step")["step"] == list(range(12))
    spans = pub.rows("span")
    forward = {
        s
        for s, p, d in zip(spans["step"], spans["phase"], spans["depth"], strict=True)
        if p == "forward" and d == 0
    }
    assert forward == (set(range(12)) if part in ("model", "submodule") else set())
    backward = {s for s, p in zip(spans["step"], spans["phase"], strict=True) if p == "backward"}
    assert backward == set(range(12))


def test_uninstalling_stops_watching_compiles() -> None:
    """After `uninstall` a compilation leaves perfloop's state alone (its callback is gone)."""
    import torch._dynamo
    from torch._dynamo.callback import callback_handler

    settings = ProducerSettings(job_id="compiled", node="n0", stats_interval_s=3600, agent=False)
    assert hooks.install(settings, publisher=FakePublisher(), command="pytest")
    torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert hooks._compile_starts in callback_handler.start_callbacks
    hooks.uninstall()
    assert hooks._compile_starts not in callback_handler.start_callbacks
    assert torch.compile is not None and not hasattr(torch.compile, "__perfloop_wrapped__")
    torch._dynamo.reset()


def test_uninstall_restores_torch(installed: FakePublisher) -> None:
    from torch.optim import optimizer as optim
    from torch.utils.data import dataloader as dl

    assert hasattr(torch.autograd.backward, "__perfloop_wrapped__")
    assert hasattr(torch.distributed.all_reduce, "__perfloop_wrapped__")
    _loop(epochs=1)
    hooks.uninstall()
    assert not hasattr(torch.autograd.backward, "__perfloop_wrapped__")
    assert not hasattr(dl._BaseDataLoaderIter.__next__, "__perfloop_wrapped__")
    assert not hasattr(torch.distributed.all_reduce, "__perfloop_wrapped__")
    assert not optim._global_optimizer_pre_hooks and not optim._global_optimizer_post_hooks


def test_a_failing_hook_never_breaks_the_script(
    installed: FakePublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise ZeroDivisionError("perfloop bug")

    monkeypatch.setattr(_hooks_loader, "_inspect_batch", broken)  # where the loader hook reads it
    monkeypatch.setattr(hooks.Tracer, "backward_end", broken)
    assert _loop(epochs=1) == 6
    assert hooks._S.errors >= 12


def test_data_loader_workers_do_not_publish(installed: FakePublisher) -> None:
    steps = _loop(epochs=1, workers=1)
    hooks.uninstall()
    assert installed.rows("step")["step"] == list(range(steps))
    assert len({e.producer_id for e in installed.events("producer")}) == 1


def test_an_explicit_monitor_takes_over(installed: FakePublisher) -> None:
    from perfloop.producers.training import Monitor

    _loop(epochs=1)
    mine = FakePublisher()
    mon = Monitor(publisher=mine)  # the job id comes from the hooks' settings
    assert len(installed.rows("step")["step"]) == 6  # the hooks' session was closed
    _loop(epochs=1)
    with mon.step():
        pass
    mon.close()
    assert len(installed.rows("step")["step"]) == 6  # nothing more from the hooks
    assert mine.rows("step")["step"] == [0]
    assert {e.job_id for e in mine.events("lifecycle")} == {"hooks-test"}


# -- the run bootstrap ---------------------------------------------------------------------
def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    other = tmp_path / "other"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("import builtins; builtins.CHAINED = True\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PERFLOOP_")}
    base.update(PYTHONPATH=str(other), PERFLOOP_HOME=str(tmp_path), PERFLOOP_KAFKA_PORT="9")
    env = child_env(base, job_id="boot", node="n0", command=["python", "x.py"])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(BOOTSTRAP_DIR)
    env.update(extra)
    return env


def test_the_bootstrap_chains_sitecustomize_and_waits_for_torch(tmp_path: Path) -> None:
    code = (
        "import builtins, sys\n"
        "print(getattr(builtins, 'CHAINED', False), 'torch' in sys.modules)\n"
        "import torch\n"
        "from perfloop.producers import hooks\n"
        "print(hooks.installed(), hooks.session() is None)\n"
    )
    out = _python(code, _env(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "True", "True"]  # installed, not active
    off = _python(code, _env(tmp_path, PERFLOOP_RUN_HOOKS="0"))
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["True", "False", "False", "True"]
