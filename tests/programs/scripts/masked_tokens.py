"""A token tagger trained on padded sequences with a hand-written masked-mean loss.

    python masked_tokens.py --steps 40 [--empty-step 25]

Each batch holds sequences of random lengths padded to a fixed width; the loss is the mean of
the per-token cross-entropy over the real (unpadded) tokens, written by hand:
`(per_token * mask).sum() / mask.sum()`. A small GRU tagger, Adam.

How it fails: `--empty-step K` makes batch K come from a shard of empty records (every length
0, a filtering bug upstream): `mask.sum()` is 0 and the loss is 0 / 0 = NaN, made by the
division of the loss line in step K. The loss is the script's own arithmetic, not a
`torch.nn.functional` loss of the model's output.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class Tagger(nn.Module):
    def __init__(self, features: int = 6, hidden: int = 16, tags: int = 5) -> None:
        super().__init__()
        self.gru = nn.GRU(features, hidden, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(x)
        return self.out(h)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--empty-step", type=int, default=-1)
    args = p.parse_args()

    torch.manual_seed(0)
    batch, width, tags = 8, 12, 5
    model = Tagger(tags=tags)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tracer = None
    if os.environ.get("NANTRACE"):  # the test suite's independent NaN tracer
        from _nantrace import Tracer
        tracer = Tracer([model], [opt])
    for step in range(args.steps):
        x = torch.randn(batch, width, 6)
        y = torch.randint(0, tags, (batch, width))
        lengths = torch.randint(1, width + 1, (batch,))
        if step == args.empty_step:
            lengths.zero_()
        mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
        if tracer:
            tracer.start(x)
        logits = model(x)
        per_token = F.cross_entropy(logits.reshape(-1, tags), y.reshape(-1),
                                    reduction="none").view(batch, width)
        loss = (per_token * mask).sum() / mask.sum()
        if tracer:
            tracer.loss(loss)
        opt.zero_grad()
        loss.backward()
        if tracer:
            tracer.grads()
        opt.step()
        if tracer:
            tracer.updated()
    print(f"done: {args.steps} steps")


if __name__ == "__main__":
    main()
