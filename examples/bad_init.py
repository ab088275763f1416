"""A classifier whose layers were initialised far too large: what `nanguard run --preflight`
is for.

Run: nanguard run --preflight-only examples/bad_init.py   (the verdict, then it stops: exit 1)
"""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 10))
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=1.0)  # the mistake: Kaiming would be ~0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


torch.manual_seed(0)
model = MLP()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step:3d}  loss {loss.item():.4g}")
