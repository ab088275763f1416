"""`log(sigmoid(z))` where sigmoid underflowed to exactly 0 (sample 7, z = -400): -inf in the
forward of `head`, at `aten.log`."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "forward", "module": "head", "op": "aten.log", "samples": [7],
            "cause": "log_of_nonpositive"}


class LogProb(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.sigmoid(z))  # should be F.logsigmoid(z)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.head = LogProb()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc.weight.fill_(1.0)
        model.fc.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(12, 4), -torch.rand(12, 1)
    x[7] = -100.0
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
