"""A hand-written softmax `exp(z) / sum(exp(z))` without subtracting the max: logits of ~200
for sample 6 overflow float32 in `aten.exp`, in the forward of `head`."""

import torch
from torch import nn

from . import Built

EXPECTED = {"phase": "forward", "module": "head", "op": "aten.exp", "samples": [6],
            "cause": "exp_overflow"}


class NaiveSoftmax(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = torch.exp(z)  # should be torch.softmax(z, -1), or exp(z - z.max())
        return e / e.sum(-1, keepdim=True)


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(10, 5)
        self.head = NaiveSoftmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def build() -> Built:
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 10), torch.randint(0, 5, (8,))
    x[6] = 400.0 * model.fc.weight[0].detach().sign()  # logit 0 of sample 6 is in the hundreds

    def step() -> torch.Tensor:
        opt.zero_grad()
        p = model(x)
        loss = -torch.log(p[torch.arange(8), y] + 1e-9).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(model=model, optimizer=opt, batch=(x, y), step=step)
