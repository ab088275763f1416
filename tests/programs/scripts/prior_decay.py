"""A classifier with an annealed class prior, trained for thousands of tiny steps.

    python prior_decay.py --steps 4000 --anneal-steps 3000 [--sanitize-grads] [--save params.pt]
                          [--grad-accum K]

Synthetic data (a fresh random batch each step, labels from a fixed linear rule), a small MLP
with dropout, SGD with momentum, `nn.CrossEntropyLoss`; with `--grad-accum K`, K micro-batches
per update, each loss divided by K before its backward (nanoGPT's gradient accumulation). The
model adds `log(prior)` to its
logits; the prior (one value per class, passed as a keyword argument) is a uniform prior
scaled by `|1 - step / anneal_steps|`: a triangular schedule meant to fade the prior out and
back in (a uniform shift of every logit: the loss does not change while it is above 0).

How it fails, late: at step `anneal_steps` the scale is exactly 0. `log(0)` is -inf, every
logit is -inf, the softmax is 0/0 and the loss NaN: the first non-finite value is made by the
log, in the forward, in that step. With `--sanitize-grads` the script zeroes non-finite
gradients before each update (`nan_to_num_`), so that one step changes nothing but momentum
and training goes on, finite, after it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn


class PriorHead(nn.Module):
    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, classes)

    def forward(self, h: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
        return self.proj(h) + torch.log(prior)


class Classifier(nn.Module):
    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, hidden), nn.Tanh(), nn.Dropout(0.1))
        self.head = PriorHead(hidden, classes)

    def forward(self, x: torch.Tensor, *, prior: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x), prior)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--anneal-steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--sanitize-grads", action="store_true")
    p.add_argument("--save", default="")
    p.add_argument("--grad-accum", type=int, default=1)
    args = p.parse_args()

    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    w_true = torch.randn(8, 4)
    loss = torch.zeros(())
    tracer = None
    if os.environ.get("NANTRACE"):  # the test suite's independent NaN tracer
        from _nantrace import Tracer
        tracer = Tracer([model], [opt])
    for step in range(args.steps):
        prior = torch.full((4,), 0.25) * abs(1.0 - step / args.anneal_steps)
        opt.zero_grad()
        for _ in range(args.grad_accum):
            x = torch.randn(args.batch, 8)
            y = (x @ w_true).argmax(1)
            if tracer:
                tracer.start(x)
            logits = model(x, prior=prior)
            loss = criterion(logits, y)
            if tracer:
                tracer.loss(loss)
            if args.grad_accum > 1:
                loss = loss / args.grad_accum
            loss.backward()
        if tracer:
            tracer.grads()
        if args.sanitize_grads:
            for param in model.parameters():
                assert param.grad is not None
                param.grad.nan_to_num_(0.0, 0.0, 0.0)
        opt.step()
        if tracer:
            tracer.updated()
    if args.save:
        torch.save(model.state_dict(), args.save)
    print(f"done: {args.steps} steps, last loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
