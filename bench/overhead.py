"""The training hooks' overhead: a real torch CPU training loop, instrumented vs not.

    python bench/overhead.py                         # 20 pairs x 50 steps, MNIST CNN
    python bench/overhead.py --pairs 3 --steps 20    # a smoke run (a few seconds)
    python bench/overhead.py --model lm              # a small transformer LM instead
    python bench/overhead.py --stack                 # publish to a private embedded stack

One process trains one model on synthetic data (``torch.set_num_threads(--threads)``) in
alternating blocks of ``--steps`` steps: hooks installed (`perfloop.producers.hooks.install`,
the same code `perfloop run` installs, default settings) and hooks removed
(`hooks.uninstall`, torch restored). The order flips every pair (ABBA) so drift cancels. Each
step is timed by the loop itself (data fetch, forward, loss, backward, optimizer). Reported:
median step time of each mode, their ratio (the target is <= 1.005 at default settings), the
median of per-pair ratios, the added time per step, and the overhead the producer accounts
for itself (`ProducerStats.overhead_pct`: time in perfloop code against step time).

Publishing goes through the real `Publisher` and `Emitter` (background flush thread, real
encoding). By default the broker is unreachable (a closed loopback port): the producer's
cost on the training node is the same whether or not a broker answers (encoding and handing
messages to librdkafka), the number does not depend on a stack starting on a shared machine,
and nothing is left behind. ``--stack`` brings up a private embedded stack (bench ports) and
publishes to it instead. Ends stdout with one JSON line (also saved under ``bench/results/``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/overhead.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import embedded_stack, raise_on_sigterm, save_result, say

TARGET_RATIO = 1.005


def _model(kind: str) -> tuple[Any, Any, Any, Any]:
    """(model, loss function, optimizer, data loader) of a small real training job."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    if kind == "cnn":  # pytorch/examples mnist/main.py, full size

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(1, 32, 3, 1)
                self.conv2 = nn.Conv2d(32, 64, 3, 1)
                self.dropout1 = nn.Dropout(0.25)
                self.dropout2 = nn.Dropout(0.5)
                self.fc1 = nn.Linear(9216, 128)
                self.fc2 = nn.Linear(128, 10)

            def forward(self, x: Any) -> Any:
                x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
                x = self.dropout2(F.relu(self.fc1(torch.flatten(self.dropout1(x), 1))))
                return F.log_softmax(self.fc2(x), dim=1)

        n = 64 * 32
        data = TensorDataset(torch.randn(n, 1, 28, 28), torch.randint(0, 10, (n,)))
        model = Net()
        opt = torch.optim.Adadelta(model.parameters(), lr=1.0)
        return model, F.nll_loss, opt, DataLoader(data, batch_size=64, shuffle=True)
    if kind == "lm":
        vocab, d, seq = 512, 128, 64
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True)

        class LM(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.embed = nn.Embedding(vocab, d)
                self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
                self.head = nn.Linear(d, vocab)

            def forward(self, x: Any) -> Any:
                return self.head(self.encoder(self.embed(x))).reshape(-1, vocab)

        tokens = torch.randint(0, vocab, (16 * 32, seq + 1))
        data = TensorDataset(tokens[:, :-1], tokens[:, 1:].reshape(len(tokens), -1))
        model = LM()

        def loss_fn(out: Any, y: Any) -> Any:
            return F.cross_entropy(out, y.reshape(-1))

        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, loss_fn, opt, DataLoader(data, batch_size=16, shuffle=True)
    raise SystemExit(f"unknown --model {kind!r}; valid: cnn, lm")


def _block(
    model: Any, loss_fn: Any, opt: Any, loader: Any, steps: int, mark: Any = None
) -> list[int]:
    """Train ``steps`` steps; return each step's wall time in ns. ``mark()`` is called once,
    before step ``steps // 2`` (to read the producer's own figures in steady state)."""
    times: list[int] = []
    it = iter(loader)
    model.train()
    while len(times) < steps:
        if mark is not None and len(times) == steps // 2:
            mark()
            mark = None
        t0 = time.perf_counter_ns()
        try:
            x, y = next(it)
        except StopIteration:
            it = iter(loader)
            continue
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter_ns() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="cnn", choices=("cnn", "lm"))
    p.add_argument("--pairs", type=int, default=20, help="instrumented/plain block pairs")
    p.add_argument("--steps", type=int, default=50, help="steps per block")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before the first pair")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--stack", action="store_true", help="publish to a private embedded stack")
    args = p.parse_args(argv)
    if args.pairs < 1 or args.steps < 5:
        p.error("need --pairs >= 1 and --steps >= 5")
    raise_on_sigterm()
    with contextlib.ExitStack() as stack:
        if args.stack:
            stack.enter_context(embedded_stack(say))
        return _run(args)
    return 1  # pragma: no cover


def _run(args: argparse.Namespace) -> int:
    import torch

    from perfloop.producers import hooks
    from perfloop.producers.publisher import Publisher
    from perfloop.settings import ProducerSettings

    torch.set_num_threads(args.threads)
    overrides: dict[str, Any] = {"job_id": f"bench-overhead-{int(time.time())}", "node": "bench"}
    spool_home = None
    if not args.stack:
        overrides["kafka_bootstrap_override"] = "127.0.0.1:9"  # discard port: refused
        spool_home = tempfile.mkdtemp(prefix="perfloop-bench-overhead-")
        overrides["home"] = Path(spool_home)  # the spool lands here and is removed after
        logging.getLogger("perfloop").addHandler(logging.NullHandler())  # "spooling" notes
    settings = ProducerSettings(**overrides)
    publisher = Publisher(settings, producer_id="bench-overhead")
    model, loss_fn, opt, loader = _model(args.model)
    say(
        f"model {args.model} ({sum(p.numel() for p in model.parameters()):,} params), "
        f"{args.threads} thread(s), {args.pairs} pairs x {args.steps} steps, broker "
        f"{'embedded stack' if args.stack else 'unreachable (' + settings.kafka_bootstrap + ')'}"
    )
    _block(model, loss_fn, opt, loader, args.warmup)
    plain: list[int] = []
    instrumented: list[int] = []
    pair_ratios: list[float] = []
    accounted: list[float] = []
    hook_us: list[float] = []
    steps_published = 0
    for i in range(args.pairs):
        medians = {}
        for mode in ("plain", "hooks") if i % 2 == 0 else ("hooks", "plain"):
            if mode == "hooks":
                hooks.install(settings, publisher=publisher, command="bench/overhead.py")
            half: list[tuple[int, int]] = []

            def mark(half: list[tuple[int, int]] = half) -> None:
                sess = hooks.session()
                if sess is not None:
                    half.append((sess.pipeline.overhead_ns, sess.pipeline.recorder.steps))

            try:
                times = _block(
                    model, loss_fn, opt, loader, args.steps, mark if mode == "hooks" else None
                )
                sess = hooks.session() if mode == "hooks" else None
                if sess is not None:
                    pipe = sess.pipeline
                    accounted.append(pipe.overhead_pct())
                    steps_published += pipe.recorder.steps
                    if half:  # the second half of the block: no start-up costs
                        o, n = half[0]
                        hook_us.append(
                            (pipe.overhead_ns - o) / 1e3 / max(pipe.recorder.steps - n, 1)
                        )
            finally:
                if mode == "hooks":
                    hooks.uninstall()
            (instrumented if mode == "hooks" else plain).extend(times)
            medians[mode] = statistics.median(times)
        pair_ratios.append(medians["hooks"] / medians["plain"])
        say(
            f"pair {i + 1:>3}: plain {medians['plain'] / 1e6:8.3f} ms  "
            f"hooks {medians['hooks'] / 1e6:8.3f} ms  ratio {pair_ratios[-1]:.4f}"
        )
    left = publisher.flush(0.5 if not args.stack else 10.0)
    with contextlib.suppress(Exception):
        publisher.close(timeout_s=0)
    if spool_home is not None:
        shutil.rmtree(spool_home, ignore_errors=True)
    m_plain, m_hooks = statistics.median(plain), statistics.median(instrumented)
    ratio = m_hooks / m_plain
    doc = {
        "bench": "overhead",
        "model": args.model,
        "threads": args.threads,
        "pairs": args.pairs,
        "steps_per_block": args.steps,
        "broker": "embedded" if args.stack else "unreachable",
        "median_step_ms_plain": round(m_plain / 1e6, 4),
        "median_step_ms_hooks": round(m_hooks / 1e6, 4),
        "ratio": round(ratio, 5),
        "pair_ratio_median": round(statistics.median(pair_ratios), 5),
        "added_us_per_step": round((m_hooks - m_plain) / 1e3, 1),
        "accounted_overhead_pct": round(statistics.median(accounted), 4) if accounted else None,
        "hooks_us_per_step": round(statistics.median(hook_us), 1) if hook_us else None,
        "steps_recorded": steps_published,
        "undelivered_messages": left,
        "target_ratio": TARGET_RATIO,
        "within_target": ratio <= TARGET_RATIO,
    }
    say(
        f"median step: plain {doc['median_step_ms_plain']} ms, hooks "
        f"{doc['median_step_ms_hooks']} ms -> ratio {doc['ratio']} (pairs: "
        f"{doc['pair_ratio_median']}), {doc['added_us_per_step']} us/step; the producer "
        f"accounts {doc['accounted_overhead_pct']}% of step time to itself (hooks "
        f"{doc['hooks_us_per_step']} us/step on the training thread, steady state); "
        f"target <= "
        f"{TARGET_RATIO}: {'met' if doc['within_target'] else 'NOT met'}"
    )
    save_result("overhead", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
