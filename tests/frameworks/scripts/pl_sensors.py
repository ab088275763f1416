"""Next-value forecasting of sensor windows with PyTorch Lightning, a script that knows nothing
of nanguard. Each window is standardized per sample before an MLP (instance normalization):

    x = (x - mean) / sqrt(var + eps)

A few sensors are dead: their windows read exactly 0.0 throughout.

    python pl_sensors.py --max-steps 12
    python pl_sensors.py --eps 0          # fails

How it fails: `--eps 0`: a dead window has zero variance, the standardization divides 0 by
sqrt(0) = 0 and the forward of the batch holding it yields NaN (division by zero); Adam then
writes NaN into every weight. The loader does not shuffle: dead row r is in step r // batch.

With NANTRACE=1 a Lightning callback drives the plain-PyTorch tracer of the program suite
(tests/programs/scripts/_nantrace.py), which establishes the first non-finite step and phase
without nanguard.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

warnings.filterwarnings("ignore", ".*does not have many workers.*")


def make_windows(n: int, length: int, dead: list[int], seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(length + 1, dtype=torch.float32)
    phase = torch.rand(n, 1, generator=g) * 2 * math.pi
    period = 8 + 8 * torch.rand(n, 1, generator=g)
    x = torch.sin(2 * math.pi * t / period + phase) + 0.05 * torch.randn(n, length + 1,
                                                                          generator=g)
    x[dead] = 0.0
    return TensorDataset(x[:, :-1], x[:, -1:])


class Forecaster(pl.LightningModule):
    def __init__(self, length: int, hidden: int, eps: float, lr: float) -> None:
        super().__init__()
        self.eps, self.lr = eps, lr
        self.net = nn.Sequential(nn.Linear(length, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=1, keepdim=True)
        var = x.var(dim=1, keepdim=True, unbiased=False)
        return self.net((x - mean) / torch.sqrt(var + self.eps))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Traced(pl.Callback):
    """Drives the independent tracer at Lightning's step points."""

    def __init__(self, model: nn.Module) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "programs" / "scripts"))
        from _nantrace import Tracer

        self.tracer = Tracer([model])

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.tracer.optimizers = list(trainer.optimizers)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, i: int) -> None:
        self.tracer.start(batch[0])

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: torch.Tensor) -> None:
        self.tracer.loss(loss)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.tracer.grads()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.tracer.updated()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pl.seed_everything(args.seed, verbose=False)
    data = make_windows(args.max_steps * args.batch_size, 16, dead=[29, 61], seed=args.seed)
    model = Forecaster(16, 32, args.eps, args.lr)
    callbacks = [Traced(model)] if os.environ.get("NANTRACE") == "1" else []
    trainer = pl.Trainer(max_steps=args.max_steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=False))
    loss = trainer.callback_metrics.get("train_loss")
    print(f"done: {args.max_steps} steps" + (f", loss {float(loss):.4f}" if loss else ""))


if __name__ == "__main__":
    main()
