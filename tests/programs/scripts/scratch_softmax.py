"""Softmax regression written from scratch, the way textbooks teach it: raw weight tensors, a
softmax by hand (`exp(z) / exp(z).sum(1)`), the cross-entropy as `-log` of the picked
probability, and a hand-written SGD step (`w -= lr * w.grad / n` under `no_grad`); no
`nn.Module`, no `torch.optim`. Synthetic 28x28 "clothing" images in [0, 1], 10 classes,
through a DataLoader.

    python scratch_softmax.py --epochs 2 --lr 0.1 [--batch-size 128]

How it fails: an LR typed far too large (`--lr 30`, 300x the default) makes the first update
move the weights by more than their own size; the next batch's logits pass `exp`'s float32
range (88.7) and `exp` returns inf (inf / inf is NaN in the softmax). The script prints
`NOTE logits beyond exp's range at update K` (K = updates before it) from its own check of
the logits, before it calls `exp`.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.utils.data import DataLoader, TensorDataset

EXP_LIMIT = math.log(torch.finfo(torch.float32).max)


def images(n: int, gen: torch.Generator) -> TensorDataset:
    templates = torch.rand(10, 784, generator=gen)
    labels = torch.randint(0, 10, (n,), generator=gen)
    pixels = (templates[labels] + 0.3 * torch.rand(n, 784, generator=gen)).clamp(0, 1)
    return TensorDataset(pixels.view(n, 1, 28, 28), labels)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--batch-size", type=int, default=128)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(images(1024, gen), batch_size=args.batch_size, shuffle=True,
                        generator=gen)
    w = torch.normal(0, 0.01, size=(784, 10), generator=gen).requires_grad_()
    b = torch.zeros(10, requires_grad=True)
    updates, noted = 0, False

    for epoch in range(args.epochs):
        total, right, seen = 0.0, 0, 0
        for x, y in loader:
            z = x.reshape(-1, 784) @ w + b
            if not noted and float(z.detach().max()) > EXP_LIMIT:
                print(f"NOTE logits beyond exp's range at update {updates}", flush=True)
                noted = True
            e = torch.exp(z)
            probs = e / e.sum(1, keepdim=True)
            loss = -torch.log(probs[torch.arange(len(y)), y])
            loss.sum().backward()
            with torch.no_grad():
                for t in (w, b):
                    t -= args.lr * t.grad / len(y)
                    t.grad.zero_()
            updates += 1
            total += float(loss.sum().detach())
            right += int((probs.argmax(1) == y).sum())
            seen += len(y)
        print(f"epoch {epoch + 1} loss {total / seen:.4f} acc {right / seen:.3f}", flush=True)


if __name__ == "__main__":
    main()
