"""A hand-written normalization `(x - mean) / std` over the batch, on a constant batch: the std
is 0 and every row becomes 0 / 0 in the forward of `norm`, at `aten.div`."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "forward", "module": "norm", "op": "aten.div", "samples": None,
            "cause": "division_by_zero"}


class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)  # should be / (x.std(0) + eps)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 8)
        self.norm = BatchStandardize()
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.ones(8, 5) * 0.5  # a constant batch (e.g. padding, or one repeated sample)
    y = torch.randn(8, 1)
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
