"""Bag-of-words sentiment classifier (EmbeddingBag + linear head) on synthetic reviews, trained
with Adam. To save memory the script can keep the whole model in float16 (`model.half()`, the
parameters themselves, no autocast, no GradScaler); the default keeps float32.

    python half_bow.py --epochs 2
    python half_bow.py --half          # fails

How it fails: `--half`: Adam's default eps=1e-8 is 0 in float16 (the smallest float16 value is
6e-8). Words that never occur in the first batch have zero gradients, so their Adam moments
stay 0 and the update divides 0 by sqrt(0) + eps = 0: NaN in the embedding at the first step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn

VOCAB = 500
BATCH = 32


def make_reviews(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reviews of 12 word ids; words < 100 lean positive, 100..199 negative."""
    g = torch.Generator().manual_seed(seed)
    label = torch.randint(0, 2, (n,), generator=g)
    words = torch.randint(200, VOCAB, (n, 12), generator=g)
    cue = torch.randint(0, 100, (n, 4), generator=g) + 100 * (1 - label[:, None])
    return torch.cat([words[:, :8], cue], dim=1), label


class BoW(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, dim, mode="mean")
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def main() -> None:
    p = argparse.ArgumentParser(description="bag-of-words sentiment")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--half", action="store_true", help="keep the model in float16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    ids, labels = make_reviews(1024, args.seed)
    model = BoW(32)
    if args.half:
        model.half()
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    for epoch in range(args.epochs):
        total = 0.0
        for b in range(len(ids) // BATCH):
            x, y = ids[b * BATCH:(b + 1) * BATCH], labels[b * BATCH:(b + 1) * BATCH]
            if tracer:
                tracer.start(x)
            loss = nn.functional.cross_entropy(model(x).float(), y)
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
        print(f"epoch {epoch}: loss {total / (len(ids) // BATCH):.4f}")


if __name__ == "__main__":
    main()
