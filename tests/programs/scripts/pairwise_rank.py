"""Learning to rank with a RankNet-style pairwise loss written out by hand: a small MLP scores
each listing, and for pairs (i, j) where i is more relevant the loss is

    log(1 + exp(-(s_i - s_j)))

averaged over the pairs of a batch. Features are standardized with training-set statistics
unless `--no-standardize`. Adam.

    python pairwise_rank.py --epochs 3
    python pairwise_rank.py --no-standardize      # fails

How it fails: `--no-standardize` feeds raw features (prices in the hundreds of thousands, areas
in the hundreds) to the scorer: score differences of thousands make `exp(-(s_i - s_j))`
overflow to inf in the loss at the first step, and its gradient inf / inf is NaN (an exp
overflow in a hand-written softplus).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

N_ITEMS = 256
BATCH = 32


def make_listings(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(price, area, rooms, distance) and a relevance score."""
    g = torch.Generator().manual_seed(seed)
    price = 100_000 + 900_000 * torch.rand(n, generator=g)
    area = 30 + 270 * torch.rand(n, generator=g)
    rooms = torch.randint(1, 7, (n,), generator=g).float()
    dist = 20 * torch.rand(n, generator=g)
    relevance = area / 100 + 0.3 * rooms - 0.1 * dist - price / 500_000
    return torch.stack([price, area, rooms, dist], dim=1), relevance


def main() -> None:
    p = argparse.ArgumentParser(description="pairwise learning to rank")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--no-standardize", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    x, rel = make_listings(N_ITEMS, args.seed)
    if not args.no_standardize:
        x = (x - x.mean(0)) / x.std(0)
    scorer = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(scorer.parameters(), lr=args.lr)

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([scorer], [optimizer])

    data = DataLoader(TensorDataset(x, rel), batch_size=BATCH, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(args.seed))
    for epoch in range(args.epochs):
        total = 0.0
        for xb, rb in data:
            if tracer:
                tracer.start(xb)
            s = scorer(xb).squeeze(1)
            better = rb[:, None] > rb[None, :]  # pairs (i, j) with i more relevant
            diff = (s[:, None] - s[None, :])[better]
            loss = torch.log(1 + torch.exp(-diff)).mean()
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
        print(f"epoch {epoch}: pairwise loss {total / (N_ITEMS // BATCH):.4f}")


if __name__ == "__main__":
    main()
