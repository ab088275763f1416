"""A Euclidean distance `sqrt(sum((a - b)**2))` at exactly zero (sample 2 has a == b).

Forward is finite (sqrt(0) = 0); the gradient is not: `SqrtBackward0` computes
`grad / (2 * result)`, so the op the checker reports is the `aten.div` inside sqrt's backward
(node `SqrtBackward0`), in the backward phase of module `dist` (the module whose forward
created the node). The `aten.mul` before it (2 * result) is still finite; the `PowBackward0`
after it turns inf * 0 into NaN, which is where a propagation-only tool would look.
"""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "backward", "module": "dist", "op": "aten.div", "samples": [2],
            "cause": "singular_gradient", "node": "SqrtBackward0"}


class Distance(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(((a - b) ** 2).sum(-1))  # should be sqrt(... + eps)


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 4)
        self.dist = Distance()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.dist(self.encoder(a), self.encoder(b))


def build() -> Built:
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    a, b, y = torch.randn(8, 6), torch.randn(8, 6), torch.rand(8)
    b[2] = a[2]
    return Built(model=model, optimizer=opt, batch=(a, b, y),
                 step=mse_step(model, opt, (a, b), y))
