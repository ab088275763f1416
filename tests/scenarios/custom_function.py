"""A custom autograd Function whose backward divides by its output: `ClampedSqrt` clamps at 0
in forward (finite) but its hand-written backward is `grad / (2 * sqrt(x))`, inf at x = 0
(sample 3). The checker sees the `aten.div` run by the Function's backward (node
`ClampedSqrtBackward`), attributed to the backward phase of `act`, the module that applied it."""

from typing import Any

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "backward", "module": "act", "op": "aten.div", "samples": [3],
            "cause": "singular_gradient", "node": "ClampedSqrtBackward"}


class ClampedSqrt(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = x.clamp(min=0).sqrt()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad / (2 * out)  # should be grad / (2 * out).clamp(min=eps)


class SqrtAct(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ClampedSqrt.apply(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 1, bias=False)
        self.act = SqrtAct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(x))


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.rand(6, 5) + 0.1, torch.rand(6, 1)
    with torch.no_grad():
        model.fc1.weight.abs_()
    x[3] = 0.0  # fc1 output is exactly 0 for sample 3
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
