"""A character-level RNN whose cell is a linear layer and a tanh, as makemore's `RNNCell`.

    python tanh_rnn.py [--learning-rate 5e-4] [--steps 40]

Synthetic names over 27 symbols, AdamW with weight decay 0.01 (makemore's defaults). The
script watches its own cell: the first step whose pre-activation (before the tanh) holds an
inf is printed with the loss of that step, which the tanh keeps finite.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn


class Cell(nn.Module):
    def __init__(self, n_in: int, n_h: int) -> None:
        super().__init__()
        self.xh_to_h = nn.Linear(n_in + n_h, n_h)
        self.saw_inf = False

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        pre = self.xh_to_h(torch.cat([x, h], 1))
        self.saw_inf |= bool(torch.isinf(pre).any())  # the script's own look
        return torch.tanh(pre)


class Rnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.cell, self.head = nn.Embedding(27, 16), Cell(16, 32), nn.Linear(32, 27)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(idx.shape[0], 32)
        out = []
        for t in range(idx.shape[1]):
            h = self.cell(self.emb(idx[:, t]), h)
            out.append(self.head(h))
        return torch.stack(out, 1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(1, 27, (512, 9), generator=g)
    model = Rnn()
    opt = torch.optim.AdamW(model.parameters(), lr=a.learning_rate, weight_decay=0.01)
    reported = False
    for step in range(a.steps):
        batch = data[torch.randint(0, 512, (32,), generator=g)]
        model.cell.saw_inf = False
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 27), batch[:, 1:].reshape(-1))
        if model.cell.saw_inf and not reported:
            reported = True
            print(f"step {step}: pre-activation inf, loss {loss.item():.4g} "
                  f"finite {math.isfinite(loss.item())}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4g}")


if __name__ == "__main__":
    main()
