"""Healthy: an L2 penalty `linalg.vector_norm` on rows that are exactly zero. torch's norm
backward computes `x / norm` (0 / 0 = NaN) and masks it to 0 at once; that transient NaN is
healed in place and must not be reported. No origin."""

import torch
from torch import nn

from . import Built

EXPECTED = {"phase": None, "module": None, "op": None, "samples": None, "cause": None}


class Penalized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.fc(x)
        return z, torch.linalg.vector_norm(z, dim=-1).mean()


def build() -> Built:
    torch.manual_seed(0)
    model = Penalized()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    x[4] = 0.0

    def step() -> torch.Tensor:
        opt.zero_grad()
        z, penalty = model(x)
        loss = nn.functional.mse_loss(z, y) + 0.1 * penalty
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(model=model, optimizer=opt, batch=(x, y), step=step)
