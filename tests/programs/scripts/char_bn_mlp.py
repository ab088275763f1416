"""A character-level name model, an MLP over the previous 3 characters with a batch norm
written by hand (the batch's mean and `std(0)`, running statistics kept under `no_grad`), the
way the "build it from scratch" lectures train it: raw tensors, minibatches drawn with
`torch.randint`, and a hand-written update (`p.data += -lr * p.grad`).

    python char_bn_mlp.py --steps 200 [--batch-size 32] [--lr 0.1]

The names are made from syllables (a fixed seed): no download.

How it fails: `--batch-size 1` (a batch of one example, e.g. to step through the code)
makes `hpre.std(0)` a standard deviation of one row: with the default correction=1 it divides
by n - 1 = 0 and the normalised activations are NaN. The script prints
`NOTE batch of 1 at update K` (K = updates before it) from the batch's own shape.
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F

SYLLABLES = ["ka", "li", "mo", "ra", "an", "el", "jo", "sa", "ne", "ty", "bri", "del"]


def dataset(block: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    rng = random.Random(0)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3)))
             for _ in range(800)]
    chars = sorted(set("".join(words)))
    index = {c: i + 1 for i, c in enumerate(chars)}  # 0 is the end-of-name mark
    xs, ys = [], []
    for w in words:
        context = [0] * block
        for ch in w + ".":
            ix = index.get(ch, 0)
            xs.append(context)
            ys.append(ix)
            context = context[1:] + [ix]
    return torch.tensor(xs), torch.tensor(ys), len(chars) + 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()
    xtr, ytr, vocab = dataset(block=3)
    g = torch.Generator().manual_seed(2147483647)
    emb = torch.randn((vocab, 10), generator=g)
    w1 = torch.randn((30, 100), generator=g) * (5 / 3) / 30 ** 0.5
    w2 = torch.randn((100, vocab), generator=g) * 0.01
    b2 = torch.zeros(vocab)
    gain, bias = torch.ones((1, 100)), torch.zeros((1, 100))
    run_mean, run_std = torch.zeros((1, 100)), torch.ones((1, 100))
    params = [emb, w1, w2, b2, gain, bias]
    for t in params:
        t.requires_grad = True

    for i in range(args.steps):
        ix = torch.randint(0, xtr.shape[0], (args.batch_size,), generator=g)
        xb, yb = xtr[ix], ytr[ix]
        if xb.shape[0] == 1 and i == 0:
            print(f"NOTE batch of 1 at update {i}", flush=True)
        hpre = emb[xb].view(xb.shape[0], -1) @ w1
        mean_i = hpre.mean(0, keepdim=True)
        std_i = hpre.std(0, keepdim=True)
        hpre = gain * (hpre - mean_i) / std_i + bias
        with torch.no_grad():
            run_mean = 0.999 * run_mean + 0.001 * mean_i
            run_std = 0.999 * run_std + 0.001 * std_i
        logits = torch.tanh(hpre) @ w2 + b2
        loss = F.cross_entropy(logits, yb)
        for t in params:
            t.grad = None
        loss.backward()
        for t in params:
            t.data += -args.lr * t.grad
        if i % 50 == 0:
            print(f"step {i:4d} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
