"""The pinpoint scenario suite: small deterministic training scripts, one root cause each.

Every module has `build() -> Built` (model, optimizer, batch and a `step()` closure doing
forward, loss, backward and `optimizer.step()`, returning the loss) and `EXPECTED`: `phase`,
`module`, `op`, `samples` (None where not meaningful), `cause` (DESIGN.md section 3; None for a
healthy run, whose `phase` is None too). Importable by tests and benchmarks with `tests/` on
`sys.path`: `from scenarios import SCENARIOS, load`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch import nn


@dataclass(kw_only=True)
class Built:
    """One scenario, ready to run its failing step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    step: Callable[[], Any]
    skip: str | None = None
    """Why this scenario cannot run here (e.g. no float16 autocast on this CPU)."""
    notes: dict[str, Any] = field(default_factory=dict)


SCENARIOS = [
    "data_nan_input",
    "data_inf_target",
    "log_sigmoid_underflow",
    "sqrt_zero",
    "norm_zero",
    "zero_std_norm",
    "masked_attention",
    "exploding_init",
    "cascade",
    "gan_bce",
    "adam_eps0",
    "autocast_overflow",
    "exp_overflow",
    "custom_function",
]
"""Failing scenarios, one root cause each."""

HEALTHY = ["healthy_mlp", "healthy_masked_attention", "healthy_norm_zero"]
"""Healthy runs: no origin may be reported (intended -inf masks, torch's masked norm
backward at zero)."""


def load(name: str) -> ModuleType:
    """The scenario module `name` (from `SCENARIOS` or `HEALTHY`)."""
    return importlib.import_module(f"{__name__}.{name}")


def mse_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Any,
             y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The plain step: zero_grad, mse loss, backward, step; returns the loss."""

    def step() -> torch.Tensor:
        optimizer.zero_grad()
        out = model(*x) if isinstance(x, tuple) else model(x)
        loss = nn.functional.mse_loss(out, y)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
