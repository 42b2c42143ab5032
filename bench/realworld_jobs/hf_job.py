"""A healthy Hugging Face ``transformers.Trainer`` job on CPU: a tiny GPT-2 built from a config
(nothing downloaded: ``HF_HUB_OFFLINE=1``) learning a synthetic token stream. It does not
import perfloop:

    python bench/realworld_jobs/hf_job.py --seconds 30 --seed 3 --truth DIR

The trainer stops after ``--steps`` optimizer steps, or after ``--seconds`` (a callback of the
script's own). Ground truth: ``none`` (healthy); ``params.trainer_steps`` is the trainer's
``state.global_step`` (the optimizer steps it ran).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from torch.utils.data import Dataset
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _jobkit import Truth, add_common_args


class Tokens(Dataset):  # type: ignore[type-arg]
    """Sequences of a repeating pattern of token ids (something a language model can learn)."""

    def __init__(self, n: int, length: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + torch.arange(length) * 7) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(TrainerCallback):
    """Records each optimizer step's end, and stops the trainer when the time is up."""

    def __init__(self, truth: Truth, seconds: float) -> None:
        self.truth, self.seconds = truth, seconds

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.truth.begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        while self.truth.steps < state.global_step:
            self.truth.step()
        if self.seconds and self.truth.elapsed_s() >= self.seconds:
            control.should_training_stop = True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p)
    p.add_argument("--steps", type=int, default=0, help="exactly this many steps (0: seconds)")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args()
    hf_logging.set_verbosity_error()
    truth = Truth(
        args.truth,
        scenario="hf_trainer",
        kind="none",
        ranks=[],
        seed=args.seed,
        report_s=args.report_s,
    )
    torch.manual_seed(args.seed)
    config = GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    out = tempfile.mkdtemp(prefix="realworld-hf-")
    targs = TrainingArguments(
        output_dir=out,
        max_steps=args.steps or 1_000_000,
        per_device_train_batch_size=args.batch_size,
        learning_rate=1e-3,
        logging_strategy="no",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=args.seed,
    )
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=Tokens(4096, 64, 512, args.seed),
        callbacks=[Clock(truth, 0.0 if args.steps else args.seconds)],
    )
    print(
        f"hf Trainer: GPT-2 {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
        f"{args.steps or args.seconds} {'steps' if args.steps else 's'}",
        flush=True,
    )
    error: BaseException | None = None
    try:
        trainer.train()
    except BaseException as e:
        error = e
        raise
    finally:
        truth.set(trainer_steps=int(trainer.state.global_step))
        truth.finish(error)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
