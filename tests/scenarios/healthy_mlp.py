"""Healthy: a small MLP with Adam on a regression batch. No origin."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": None, "module": None, "op": None, "samples": None, "cause": None}


def build() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
