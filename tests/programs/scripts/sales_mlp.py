"""Weekly sales regression: an MLP on store features, SGD with momentum, a DataLoader.

    python sales_mlp.py [--lr 0.02] [--epochs 4]

An LR too large for momentum 0.9 on these targets makes the weights grow step after step:
* `--lr 0.1`: a hidden Linear layer's output overflows float32 first (the forward, at the
  line that calls the model);
* `--lr 0.3`: the predictions are still finite when their squared error overflows (`mse_loss`,
  the loss phase, at the loss's line).

The script prints `step N loss L` per step; the test establishes the failure from those prints
and from an independent check (NaNTrace), never from nanguard.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def table(rows: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    y = 3.0 * x @ w + 0.1 * torch.randn(rows, 1, generator=g)
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--epochs", type=int, default=4)
    a = p.parse_args()
    torch.manual_seed(0)
    data = table(512)
    loader = DataLoader(data, batch_size=64, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [opt])
    step = 0
    for _ in range(a.epochs):
        for xb, yb in loader:
            if tracer:
                tracer.start((xb, yb))
            pred = model(xb)  # FORWARD LINE
            loss = F.mse_loss(pred, yb)  # LOSS LINE
            if tracer:
                tracer.loss(loss)
            opt.zero_grad()
            loss.backward()
            if tracer:
                tracer.grads()
            opt.step()
            if tracer:
                tracer.updated()
            print(f"step {step} loss {loss.item():.4g}", flush=True)
            step += 1


if __name__ == "__main__":
    main()
