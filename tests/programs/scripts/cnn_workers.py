"""A small CNN classifier on synthetic 16x16 images, the way image-classification scripts do it.

    python cnn_workers.py [--lr 3e-3] [--epochs 2] [--accum 2] [--workers 2] [--bf16]
                          [--nan-index N] [--out ckpt]

A map-style Dataset, a shuffled DataLoader with worker processes (batches reach the main
process through shared memory), Conv + BatchNorm + ReLU blocks, AdamW with a cosine schedule
stepped per update, optional bf16 autocast on the CPU, gradient accumulation (each micro-batch's
loss divided by `--accum`), clipping at 1.0, an eval pass under no_grad and a checkpoint each
epoch. `--nan-index N` puts one NaN pixel into image N of the data set.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


class Images(Dataset):
    def __init__(self, n: int, nan_index: int = -1) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 3, 16, 16, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        if nan_index >= 0:
            self.x[nan_index, 0, 3, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.b1(self.c1(x))), 2)
        x = F.max_pool2d(F.relu(self.b2(self.c2(x))), 2)
        return self.fc(x.flatten(1))


BATCH = 32


def loader(ds: Dataset, workers: int) -> DataLoader:
    return DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers,
                      generator=torch.Generator().manual_seed(0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--nan-index", type=int, default=-1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default="ckpt")
    a = p.parse_args()
    torch.manual_seed(0)
    ds = Images(512, a.nan_index)
    dl = loader(ds, a.workers)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    total = a.epochs * len(dl) // a.accum
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    tracer = None
    if os.environ.get("NANTRACE"):  # the test suite's independent NaN tracer
        from _nantrace import Tracer
        tracer = Tracer([model], [opt])
    os.makedirs(a.out, exist_ok=True)
    step = 0
    for epoch in range(a.epochs):
        model.train()
        for i, (x, y) in enumerate(dl):
            if tracer:
                tracer.start(x)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                loss = F.cross_entropy(model(x), y)
            if tracer:
                tracer.loss(loss)
            (loss / a.accum).backward()
            if (i + 1) % a.accum == 0:
                if tracer:
                    tracer.grads()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if tracer:
                    tracer.updated()
                opt.zero_grad(set_to_none=True)
                sched.step()
                step += 1
                if step % 4 == 0:
                    print(f"epoch {epoch} step {step} loss {loss.item():.4f}")
        model.eval()
        with torch.no_grad():
            acc = (model(ds.x[:128]).argmax(1) == ds.y[:128]).float().mean().item()
        print(f"epoch {epoch}: acc {acc:.3f}")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(a.out, "last.pt"))


if __name__ == "__main__":
    main()
