"""Semi-supervised classification of 2-D points (two moons): only some points carry a label
(-1 marks an unlabelled one). Each batch's loss is the cross-entropy over its labelled points
plus a consistency term over all points (the prediction should not change under a small
input jitter), in the style of Pi-model / FixMatch training loops. Shuffled DataLoader, SGD
with momentum.

    python semi_supervised.py --labelled 256
    python semi_supervised.py --labelled 48      # fails

How it fails: with few labels (`--labelled 48` of 512 points, batches of 16), some batch holds
no labelled point: `F.cross_entropy(logits[labelled], y[labelled])` is the mean over an empty
selection, 0 / 0 = NaN (division by zero), and SGD writes it into every weight.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

N_POINTS = 512
BATCH = 16


def make_moons(n: int, labelled: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points and labels; all but `labelled` evenly spaced points get label -1."""
    g = torch.Generator().manual_seed(seed)
    half = n // 2
    t = math.pi * torch.rand(n, generator=g)
    upper = torch.stack([torch.cos(t[:half]), torch.sin(t[:half])], dim=1)
    lower = torch.stack([1 - torch.cos(t[half:]), 0.5 - torch.sin(t[half:])], dim=1)
    x = torch.cat([upper, lower]) + 0.1 * torch.randn(n, 2, generator=g)
    y = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(n - half, dtype=torch.long)])
    keep = torch.zeros(n, dtype=torch.bool)
    keep[torch.linspace(0, n - 1, labelled).long()] = True
    return x, torch.where(keep, y, torch.full_like(y, -1))


def loader(x: torch.Tensor, y: torch.Tensor, seed: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))


def main() -> None:
    p = argparse.ArgumentParser(description="semi-supervised two moons")
    p.add_argument("--labelled", type=int, default=256)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--consistency", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    x, y = make_moons(N_POINTS, args.labelled, args.seed)
    model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    for epoch in range(args.epochs):
        total = 0.0
        for xb, yb in loader(x, y, args.seed + epoch):
            if tracer:
                tracer.start(xb)
            logits = model(xb)
            jittered = model(xb + 0.05 * torch.randn_like(xb))
            labelled = yb >= 0
            supervised = F.cross_entropy(logits[labelled], yb[labelled])
            consistency = F.mse_loss(F.softmax(jittered, -1), F.softmax(logits, -1).detach())
            loss = supervised + args.consistency * consistency
            if tracer:
                tracer.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            if tracer:
                tracer.grads()
            optimizer.step()
            if tracer:
                tracer.updated()
            total += loss.item()
        print(f"epoch {epoch}: loss {total / (N_POINTS // BATCH):.4f}")


if __name__ == "__main__":
    main()
