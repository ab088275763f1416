"""A tiny seeded LightningModule and data set for the Lightning adapter tests (CPU, float32).

`make_data(n, bad_row)` gives a regression data set whose row `bad_row` (if any) holds a NaN;
with `BATCH` rows per batch and no shuffling that row lands in step `bad_row // BATCH`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover
    import pytorch_lightning as pl  # type: ignore[no-redef]

BATCH = 8
DIM = 6

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")


def make_data(n: int, bad_row: int | None = None, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=g)
    y = x @ torch.randn(DIM, 1, generator=g) + 0.05 * torch.randn(n, 1, generator=g)
    if bad_row is not None:
        x[bad_row, 2] = float("nan")
    return TensorDataset(x, y)


class Regressor(pl.LightningModule):
    def __init__(self, seed: int = 0, lr: float = 0.05, scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 1))
        self.lr = lr
        self.scheduler = scheduler

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(data: TensorDataset) -> DataLoader:
    return DataLoader(data, batch_size=BATCH, shuffle=False, num_workers=0)


def trainer(callbacks: list[Any], max_steps: int, **kw: Any) -> pl.Trainer:
    args: dict[str, Any] = dict(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    args.update(kw)
    return pl.Trainer(callbacks=callbacks, **args)


class ParamRecorder(pl.Callback):
    """Copies of the parameters after every optimizer step (on_train_batch_end)."""

    def __init__(self) -> None:
        self.after: list[list[torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.after.append([p.detach().clone() for p in pl_module.parameters()])
