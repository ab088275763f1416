"""A training script that knows nothing of nanguard: argparse, an LR scheduler, a main guard.

Run:  python examples/scheduler_argparse.py --steps 80
      nanguard run examples/scheduler_argparse.py --steps 80 --poison-step 40
(`--poison-step N` puts a NaN into sample `--poison-sample` of batch N; `--exit-code` ends the
script with that code, to show that `nanguard run` keeps it.)
"""

import argparse

import torch
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--poison-step", type=int, default=-1, help="plant a NaN in this batch")
    p.add_argument("--poison-sample", type=int, default=5)
    p.add_argument("--exit-code", type=int, default=0, help="exit with this code at the end")
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=10)
    decay = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, args.steps - 10))
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, decay], milestones=[10])
    target = torch.randn(16, 4)
    loss = torch.tensor(0.0)
    for step in range(args.steps):
        x = torch.randn(args.batch_size, 16)
        y = x @ target + 0.1 * torch.randn(args.batch_size, 4)
        if step == args.poison_step:
            x[args.poison_sample, 3] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        if step % 20 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}  lr {scheduler.get_last_lr()[0]:.4f}")
    print(f"done: {args.steps} steps, final loss {loss.item():.4f}")
    return args.exit_code


if __name__ == "__main__":
    raise SystemExit(main())
