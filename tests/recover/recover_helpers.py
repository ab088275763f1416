"""Shared pieces of the recovery tests: a tiny seeded model, pre-built batches, a plain training
loop with optional guard / scheduler / poisoned steps, and bitwise state comparison."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from nanguard import GuardConfig, RecordConfig

DIM = 8
Batch = tuple[torch.Tensor, torch.Tensor]


def make_model(seed: int, *, bn_dropout: bool = False) -> nn.Module:
    """A small MLP; with `bn_dropout`, also a BatchNorm (buffers) and a Dropout (RNG)."""
    torch.manual_seed(seed)
    if bn_dropout:
        return nn.Sequential(
            nn.Linear(DIM, 32), nn.BatchNorm1d(32), nn.GELU(), nn.Dropout(0.2), nn.Linear(32, 1)
        )
    return nn.Sequential(nn.Linear(DIM, 32), nn.GELU(), nn.Linear(32, 1))


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    raise ValueError(kind)


def make_batches(steps: int, seed: int = 0, batch: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(1000 + seed)
    w = torch.randn(DIM, 1, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, DIM, generator=g)
        out.append((x, torch.tanh(x @ w) + 0.05 * torch.randn(batch, 1, generator=g)))
    return out


def poison(batch: Batch) -> Batch:
    x, y = batch
    x = x.clone()
    x[2, 3] = math.nan
    return x, y


def quiet(policy: str = "observe", **kw: Any) -> GuardConfig:
    """A GuardConfig that records nothing and prints nothing."""
    return GuardConfig(policy=policy, record=RecordConfig(out="", summary=False), **kw)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    guard: Any = None,
    scheduler: Any = None,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """The loop the Guard docstring documents; `on_step(i)` runs after step i (and the
    scheduler's step)."""
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(i)
    return losses


def lr_used(optimizer: torch.optim.Optimizer) -> list[float]:
    """Register a step pre-hook (after any guard's) that records the LR each update uses."""
    seen: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: seen.append(opt.param_groups[0]["lr"]))
    return seen


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bitwise equality of nested state (tensors compared with torch.equal, NaN-safe floats)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: {a.keys()} != {b.keys()}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_training(model_a, opt_a, model_b, opt_b) -> None:
    """Parameters, buffers and the full optimizer state_dict are bitwise equal."""
    assert_same(model_a.state_dict(), model_b.state_dict(), "model")
    assert_same(opt_a.state_dict(), opt_b.state_dict(), "optimizer")
