"""Angular metric learning on pairs: an encoder maps each item to per-dimension angles
(`acos` of a bounded projection) and training pulls the two angles of a pair together.

    python pair_angles.py [--margin 0.0] [--steps 10]

`--margin M` widens the projection's range to +-(1 + M) before the `acos`: with M > 0 some
entries leave acos's domain [-1, 1] and the angles are NaN from the first forward on. The
encoder runs twice per step (both items of a pair) and the loss is the script's own
arithmetic. The script prints `step N loss L` per step; the test establishes the failure
from those prints and from an independent check (NaNTrace), never from nanguard.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn


class AngleEncoder(nn.Module):
    def __init__(self, dim: int, margin: float) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = 1.0 + margin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(x)) * self.scale
        return torch.acos(h)  # ACOS LINE


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--margin", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    torch.manual_seed(0)
    model = AngleEncoder(8, a.margin)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    left, right = torch.randn(32, 8), torch.randn(32, 8)
    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [opt])
    for step in range(a.steps):
        if tracer:
            tracer.start((left, right))
        d = model(left) - model(right)
        loss = (d * d).mean()
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


if __name__ == "__main__":
    main()
