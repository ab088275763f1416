"""Shared by the masked-attention scenarios: single-head self-attention with a key mask."""

import math

import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(1, 2) / math.sqrt(x.shape[-1])
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ self.v(x)


class Encoder(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.attn = Attention(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(self.embed(x), keep)).mean(1)


def make(keep: torch.Tensor):  # type: ignore[no-untyped-def]
    from . import Built, mse_step

    torch.manual_seed(0)
    model = Encoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(keep.shape[0], keep.shape[1], 8), torch.randn(keep.shape[0], 1)
    return Built(model=model, optimizer=opt, batch=(x, keep, y),
                 step=mse_step(model, opt, (x, keep), y))
