"""A small GAN on a 2-D Gaussian mixture: two models, two optimizers, one loop.

Run:  python examples/gan_two_optimizers.py
      nanguard run examples/gan_two_optimizers.py --poison-step 30
`nanguard run` attaches a guard to each optimizer (one record each, plus a merged report);
`--poison-step N` puts a NaN into sample `--poison-sample` of the real batch N.
"""

import argparse
import math

import torch
from torch import nn


def real_batch(n: int) -> torch.Tensor:
    """Points around 8 centres on a circle."""
    k = torch.randint(0, 8, (n,))
    angle = k.float() * (2 * math.pi / 8)
    centres = torch.stack([angle.cos(), angle.sin()], dim=1) * 2.0
    return centres + 0.05 * torch.randn(n, 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--poison-step", type=int, default=-1)
    p.add_argument("--poison-sample", type=int, default=11)
    args = p.parse_args()
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(discriminator.parameters(), lr=1e-3, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    ones = torch.ones(args.batch_size, 1)
    zeros = torch.zeros(args.batch_size, 1)
    for step in range(args.steps):
        real = real_batch(args.batch_size)
        if step == args.poison_step:
            real[args.poison_sample, 0] = float("nan")
        fake = generator(torch.randn(args.batch_size, 8))
        # Discriminator: real vs (detached) fake.
        d_loss = bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        # Generator: fool the discriminator.
        g_loss = bce(discriminator(fake), ones)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        if step % 20 == 0:
            print(f"step {step:4d}  d_loss {d_loss.item():.4f}  g_loss {g_loss.item():.4f}")
    print(f"done: {args.steps} steps")


if __name__ == "__main__":
    main()
