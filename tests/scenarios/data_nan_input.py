"""A NaN in one feature of one input row (sample 5): the data phase, entering at `fc1`."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "data", "module": "fc1", "op": "aten.addmm", "samples": [5],
            "cause": "data_nonfinite"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    x[5, 2] = float("nan")
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
