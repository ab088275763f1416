"""Click-count regression with the transformers `Trainer`, a script that knows nothing of
nanguard: a tiny BERT built from a config (random init, nothing downloaded) reads synthetic
token ids and predicts how many clicks a text gets. Counts are skewed, so the model is fit in
log space (an RMSLE-style loss in a `Trainer` subclass):

    loss = mse(pred, log(clicks + offset))      # offset 1 makes it log1p

    python hf_clicks.py --max-steps 12
    python hf_clicks.py --log-offset 0    # fails: the "log1p" written as a plain log

How it fails: `--log-offset 0`: a text with 0 clicks gives log(0) = -inf in the loss, the
gradient is NaN and AdamW writes it into every weight. The Trainer samples in a seeded random
order, so which step holds the first zero-click text is established by the tracer.

With NANTRACE=1 a TrainerCallback drives the plain-PyTorch tracer of the program suite
(tests/programs/scripts/_nantrace.py), which establishes the first non-finite step and phase
without nanguard.
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
from torch.utils.data import Dataset
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

warnings.filterwarnings("ignore")


class Clicks(Dataset):
    """Token ids; texts holding token 7 get many clicks; every 23rd text got none."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, vocab, (n, seq), generator=g)
        rate = 3.0 + 20.0 * (self.ids == 7).any(1).float()
        self.clicks = torch.poisson(rate, generator=g).clamp_min(1.0)
        self.clicks[::23] = 0.0

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.clicks[i]}


class LogSpaceTrainer(Trainer):
    """MSE in log space (RMSLE's square)."""

    log_offset = 1.0

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        clicks = inputs.pop("labels")
        out = model(**inputs)
        pred = out.logits.squeeze(-1)
        loss = nn.functional.mse_loss(pred, torch.log(clicks + self.log_offset))
        return (loss, out) if return_outputs else loss


class Traced(TrainerCallback):
    """Drives the independent tracer at the Trainer's step points."""

    def __init__(self, model: nn.Module) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "programs" / "scripts"))
        from _nantrace import Tracer

        self.tracer = Tracer([model])
        self.model = model

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                       **kw: Any) -> None:
        self.tracer.optimizers = [getattr(optimizer, "optimizer", optimizer)]

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.tracer.start(None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.tracer.grads()

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.tracer.updated()


class TracedTrainer(LogSpaceTrainer):
    """Hands the loss to the tracer (only under NANTRACE=1)."""

    tracer: Any = None

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.tracer.loss(result[0] if return_outputs else result)
        return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--log-offset", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out-dir", default="hf_out")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16, num_labels=1,
                     problem_type="regression")
    model = BertForSequenceClassification(cfg)
    data = Clicks(args.max_steps * args.batch_size, 12, 64, args.seed)
    targs = TrainingArguments(output_dir=args.out_dir, per_device_train_batch_size=args.batch_size,
                              max_steps=args.max_steps, learning_rate=args.lr, report_to=[],
                              save_strategy="no", logging_steps=4, use_cpu=True,
                              dataloader_num_workers=0, disable_tqdm=True, seed=args.seed)
    traced = os.environ.get("NANTRACE") == "1"
    cls = TracedTrainer if traced else LogSpaceTrainer
    cls.log_offset = args.log_offset
    callbacks: list[TrainerCallback] = []
    if traced:
        cb = Traced(model)
        TracedTrainer.tracer = cb.tracer
        callbacks.append(cb)
    trainer = cls(model=model, args=targs, train_dataset=data, callbacks=callbacks)
    result = trainer.train()
    print(f"done: {result.global_step} steps, loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
