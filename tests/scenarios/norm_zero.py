"""Normalizing by `linalg.vector_norm` of a row that is exactly zero (sample 4): 0 / 0 in the
forward of `proj`, at `aten.div`.

torch's own norm backward is safe at zero (it computes `x / norm` and masks the NaN right
away); the checker must not blame that transient NaN (see `healthy_norm_zero`). The failure
users hit is dividing by the norm: `z / ||z||` without a floor (`F.normalize` has one).
"""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "forward", "module": "proj", "op": "aten.div", "samples": [4],
            "cause": "division_by_zero"}


class UnitNorm(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z / torch.linalg.vector_norm(z, dim=-1, keepdim=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 4, bias=False)
        self.proj = UnitNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.fc(x))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(8, 6), torch.randn(8, 4)
    x[4] = 0.0
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
