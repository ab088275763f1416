"""A tiny DDPM on 2-D points: a noise-prediction MLP conditioned on a sinusoidal timestep
embedding, the usual linear beta schedule, mini-batches from a DataLoader.

    python tiny_diffusion.py [--steps 40] [--time-dim 16] [--batch 64] [--lr 1e-3]

How it fails: `--time-dim 2` makes the embedding's half size 1, and its frequencies
`exp(-log(10000) * arange(half) / (half - 1))` divide by the Python number 0 (0 / 0 = NaN for
the first frequency). The script prints `NOTE half-1 = 0 at update K` (its own arithmetic) the
first time the embedding is built that way.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

_noted = False


def timestep_embedding(t: torch.Tensor, dim: int, updates: int) -> torch.Tensor:
    global _noted
    half = dim // 2
    if half - 1 == 0 and not _noted:
        _noted = True
        print(f"NOTE half-1 = 0 at update {updates}", flush=True)
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / (half - 1))
    args = t[:, None].float() * freqs[None]
    return torch.cat([args.sin(), args.cos()], dim=-1)


class Denoiser(nn.Module):
    def __init__(self, time_dim: int) -> None:
        super().__init__()
        self.time_dim = time_dim
        self.net = nn.Sequential(nn.Linear(2 + 2 * (time_dim // 2), 64), nn.SiLU(),
                                 nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 2))

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, emb], dim=-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--time-dim", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--timesteps", type=int, default=100)
    args = p.parse_args()

    torch.manual_seed(0)
    angle = torch.rand(512) * 2 * math.pi
    points = torch.stack([angle.cos(), angle.sin()], dim=1) * 2 + 0.05 * torch.randn(512, 2)
    loader = DataLoader(TensorDataset(points), batch_size=args.batch, shuffle=True)
    betas = torch.linspace(1e-4, 0.02, args.timesteps)
    alpha_bar = torch.cumprod(1 - betas, dim=0)
    model = Denoiser(args.time_dim)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    updates = 0
    while updates < args.steps:
        for (x0,) in loader:
            t = torch.randint(0, args.timesteps, (x0.shape[0],))
            noise = torch.randn_like(x0)
            ab = alpha_bar[t][:, None]
            xt = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
            pred = model(xt, timestep_embedding(t, args.time_dim, updates))
            loss = nn.functional.mse_loss(pred, noise)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1
            if updates >= args.steps:
                break
        print(f"update {updates} loss {loss.item():.4f}")
    print("done")


if __name__ == "__main__":
    main()
