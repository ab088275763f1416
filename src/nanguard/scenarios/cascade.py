"""The LR/momentum cascade: the failure users know as a sudden `loss: nan`.

An MLP with LeakyReLU(0.01) regresses a linear target with SGD (momentum 0.9, lr 0.05). Rarely
(probability 0.005 per step) one sample of a batch is 25x larger than the rest: a gradient spike.
Some seeds absorb it; in others momentum and the now-larger weights feed each other for about six
steps (grad norm ~1 -> 200 -> 1e4 -> 1e7 -> ...) until the last Linear layer overflows float32.
Everything is seeded: the same seed fails at the same step, bit for bit, on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

DIM = 16
BATCH = 32


@dataclass(kw_only=True)
class CascadeSetup:
    """Everything one seed of the scenario needs."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def step_loss(model: nn.Module, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
              batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One step's forward and loss. Training calls it, and so does the demo's guard to replay a
    step (`Guard(replay=...)`): the op a replay finds ran on the same line as in training."""
    x, y = batch
    return loss_fn(model(x), y)


def _batches(
    seed: int, steps: int, outlier_p: float, outlier_scale: float, outlier_at: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=g) / math.sqrt(DIM)
    for step in range(steps):
        x = torch.randn(BATCH, DIM, generator=g)
        if torch.rand(1, generator=g).item() < outlier_p or step == outlier_at:
            x[0] *= outlier_scale
        y = x @ w + 0.1 * torch.randn(BATCH, 1, generator=g)
        yield x, y


def make_cascade(
    seed: int,
    *,
    steps: int = 300,
    lr: float = 0.05,
    momentum: float = 0.9,
    outlier_p: float = 0.005,
    outlier_scale: float = 25.0,
    outlier_at: int | None = None,
) -> CascadeSetup:
    """Build model, optimizer and the seeded stream of `steps` batches for one seed.

    `outlier_at` also plants the outlier sample at that step (an early failure: the end of a
    warm-up, the first batches of a fine-tune)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(DIM, 64), nn.LeakyReLU(0.01),
        nn.Linear(64, 64), nn.LeakyReLU(0.01),
        nn.Linear(64, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    return CascadeSetup(
        model=model, optimizer=optimizer,
        batches=_batches(seed, steps, outlier_p, outlier_scale, outlier_at),
        loss_fn=nn.functional.mse_loss,
    )


def train_cascade(
    seed: int, guard_factory: Callable[[nn.Module, torch.optim.Optimizer], Any] | None = None,
    **kwargs: Any,
) -> tuple[CascadeSetup, list[float]]:
    """Train one seed to the end (no early stop), optionally under a guard from `guard_factory`.

    Returns the setup (model and optimizer in their final state) and the loss of every step.
    The guard, if any, is closed before returning; an exception from it propagates.
    """
    setup = make_cascade(seed, **kwargs)
    guard = guard_factory(setup.model, setup.optimizer) if guard_factory else None
    losses: list[float] = []
    try:
        for x, y in setup.batches:
            loss = step_loss(setup.model, setup.loss_fn, (x, y))
            if guard is not None:
                guard.watch(loss=loss, batch=(x, y))
            setup.optimizer.zero_grad()
            loss.backward()
            setup.optimizer.step()
            losses.append(loss.item())
    finally:
        if guard is not None:
            guard.close()
    return setup, losses
