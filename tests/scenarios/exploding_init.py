"""A deep ReLU MLP initialized with std 10 (He init would be ~0.18): activations grow ~50x per
layer and overflow float32 in the forward of one Linear layer, at `aten.addmm`. The expected
layer is also checked against plain forward hooks in the tests."""

import torch
from torch import nn

from . import Built, mse_step

EXPECTED = {"phase": "forward", "module": "layers.42", "op": "aten.addmm", "samples": None,
            "cause": "exploding_init"}
DEPTH = 24


def build() -> Built:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(DEPTH):
        lin = nn.Linear(64, 64)
        nn.init.normal_(lin.weight, std=10.0)
        blocks += [lin, nn.ReLU()]
    model = nn.Sequential()
    model.add_module("layers", nn.Sequential(*blocks))
    model.add_module("out", nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    return Built(model=model, optimizer=opt, batch=(x, y), step=mse_step(model, opt, x, y))
