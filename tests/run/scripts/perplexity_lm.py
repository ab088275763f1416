"""A tiny bigram language model that prints its perplexity, `math.exp(loss)`, every step, as
language-model scripts do (pytorch/examples' word_language_model among them).

    python perplexity_lm.py [--lr 0.5] [--steps 30] [--fail-at N] [--exit-above X]
                            [--hand-written]

Synthetic tokens (a fixed random walk over 50 symbols), an embedding and a linear head, SGD at
`--lr`. At a far too high LR the loss runs away and `math.exp` of it overflows: the script
dies of its own OverflowError. `--fail-at N` raises a KeyError of the script's own at step N
(a bookkeeping bug, nothing numerical). `--exit-above X` ends the script with its own
`sys.exit` message when a loss exceeds X (a hand-written divergence check). `--hand-written`
applies the SGD update itself (`p.add_(p.grad, alpha=-lr)`, as word_language_model's `train()`
does), with no optimizer.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 50


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--exit-above", type=float, default=math.inf)
    p.add_argument("--hand-written", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.cumsum(torch.randint(-2, 3, (4096,), generator=g), 0) % VOCAB
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Linear(32, VOCAB))
    opt = None if a.hand_written else torch.optim.SGD(model.parameters(), lr=a.lr)
    seen: dict[str, int] = {}
    for step in range(a.steps):
        i = torch.randint(0, len(tokens) - 1, (64,), generator=g)
        loss = F.cross_entropy(model(tokens[i]), tokens[i + 1])
        model.zero_grad()
        loss.backward()
        if opt is None:
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(q.grad, alpha=-a.lr)
        else:
            opt.step()
        if loss.item() > a.exit_above:
            sys.exit(f"loss {loss.item():.4g} above {a.exit_above:g}: stopping")
        if step == a.fail_at:
            seen["epoch"] += 1  # the script's own bug: no such key yet
        print(f"step {step} loss {loss.item():.2f} ppl {math.exp(loss.item()):.2f}", flush=True)


if __name__ == "__main__":
    main()
