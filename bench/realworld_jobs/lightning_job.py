"""A healthy PyTorch Lightning job on CPU: a ``LightningModule`` (a small MLP classifier on
synthetic data) trained by ``lightning.Trainer``, as its documentation shows. It does not
import perfloop:

    python bench/realworld_jobs/lightning_job.py --seconds 30 --seed 3 --truth DIR

The trainer stops after ``--steps`` optimizer steps, or after ``--seconds`` (a callback of the
script's own). Ground truth: ``none`` (healthy); ``params.trainer_steps`` is the trainer's
``global_step`` (the optimizer steps it ran).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobkit import Truth, add_common_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore", ".*does not have many workers.*")

import lightning as L  # noqa: E402


class Classifier(L.LightningModule):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(128, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Clock(L.Callback):
    """Records each optimizer step's end, and stops the trainer when the time is up."""

    def __init__(self, truth: Truth, seconds: float) -> None:
        self.truth, self.seconds = truth, seconds

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.truth.begin()

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        while self.truth.steps < trainer.global_step:
            self.truth.step()
        if self.seconds and self.truth.elapsed_s() >= self.seconds:
            trainer.should_stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=0, help="exactly this many steps (0: seconds)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=512)
    args = p.parse_args()
    truth = Truth(
        args.truth,
        scenario="lightning",
        kind="none",
        ranks=[],
        seed=args.seed,
        report_s=args.report_s,
    )
    L.seed_everything(args.seed, verbose=False)
    g = torch.Generator().manual_seed(args.seed)
    data = TensorDataset(torch.randn(8192, 128, generator=g), torch.randint(0, 10, (8192,)))
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps or -1,
        max_epochs=-1 if not args.steps else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock(truth, 0.0 if args.steps else args.seconds)],
    )
    print(
        f"lightning {L.__version__}: {args.steps or args.seconds} {'steps' if args.steps else 's'}",
        flush=True,
    )
    error: BaseException | None = None
    try:
        trainer.fit(Classifier(args.width), loader)
    except BaseException as e:
        error = e
        raise
    finally:
        truth.set(trainer_steps=int(trainer.global_step))
        truth.finish(error)


if __name__ == "__main__":
    main()
