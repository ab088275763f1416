"""An Inf in one regression target (sample 3): the data phase, entering at the loss."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "data", "module": None, "op": "aten.mse_loss", "samples": [3],
            "cause": "label_nonfinite"}


def build() -> Built:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    y[3, 0] = float("inf")
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
