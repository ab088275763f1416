"""Logistic regression the textbook way: raw tensors, no `nn.Module`, the cost written out.

    python raw_logreg.py --epochs 100 --lr 0.1 [--update sgd|manual] [--batch 32] [--save F]

Two Gaussian blobs (a fixed seed) are separated by `h = sigmoid(X @ W + b)` with the cost
`-(Y * log(h) + (1 - Y) * log(1 - h)).mean()`, trained in mini-batches either by
`torch.optim.SGD([W, b])` or by hand (`W -= lr * W.grad` under `no_grad`).

How it fails: the blobs are separable, so the weights grow for as long as it trains. Run long
enough (`--epochs 250`: step 1531 at `--lr 0.1`; sooner with a larger LR) and the margin of
some sample passes float32's resolution of the sigmoid: `h` rounds to exactly 0 or 1, a
`log` of it is `-inf` and the cost is NaN (`0 * -inf`). The data stay finite; the cause is the
log of a probability that rounded to 0 or 1. Under the tracer the script also prints
`NANTRACE_SATURATED K` at the first step K where some `h` is exactly 0 or 1.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--update", choices=("sgd", "manual"), default="sgd")
    p.add_argument("--save", default=None, help="write W and b here at the end")
    args = p.parse_args()

    torch.manual_seed(0)
    n = 256
    X = torch.cat([torch.randn(n // 2, 2) + 2.0, torch.randn(n // 2, 2) - 2.0])
    Y = torch.cat([torch.ones(n // 2, 1), torch.zeros(n // 2, 1)])
    W = torch.zeros(2, 1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([W, b], lr=args.lr) if args.update == "sgd" else None
    tracer, saturated = None, False
    if os.environ.get("NANTRACE"):  # the test suite's independent NaN tracer
        from _nantrace import Tracer
        tracer = Tracer([], [opt] if opt is not None else [])
    for epoch in range(args.epochs):
        order = torch.randperm(n)
        for i in range(0, n, args.batch):
            idx = order[i:i + args.batch]
            x, y = X[idx], Y[idx]
            if tracer:
                tracer.start(x)
            h = torch.sigmoid(x @ W + b)
            if tracer and not saturated and bool(((h == 0) | (h == 1)).any()):
                saturated = True
                print(f"NANTRACE_SATURATED {tracer.step}", file=sys.stderr, flush=True)
            cost = -(y * torch.log(h) + (1 - y) * torch.log(1 - h)).mean()
            if tracer:
                tracer.loss(cost)
            if opt is not None:
                opt.zero_grad()
            else:
                W.grad = b.grad = None
            cost.backward()
            if opt is not None:
                opt.step()
            else:
                with torch.no_grad():
                    W -= args.lr * W.grad
                    b -= args.lr * b.grad
            if tracer:
                tracer.updated()
        if epoch % 50 == 0:
            print(f"epoch {epoch} cost {cost.item():.4f}")
    if args.save:
        torch.save({"W": W.detach(), "b": b.detach()}, args.save)
    print("done")


if __name__ == "__main__":
    main()
