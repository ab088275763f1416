"""Adam with eps=0 on a weight column whose gradient is exactly 0 (input feature 3 is always 0):
exp_avg = exp_avg_sq = 0, so the update is 0 / 0 = NaN, written into `fc1.weight` inside
`optimizer.step()` (single-tensor Adam on CPU: `aten.addcdiv_`)."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "optimizer", "module": "fc1", "op": "aten.addcdiv_", "samples": None,
            "cause": "optimizer_state_nonfinite", "param": "fc1.weight"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0, foreach=False)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    x[:, 3] = 0.0  # a feature that is always 0 (a padding column, a dead one-hot category)
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
