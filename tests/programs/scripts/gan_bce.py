"""A vanilla GAN on 2-D points (the "8 Gaussians" toy problem), in the style of the classic
PyTorch GAN tutorials: a generator and a discriminator (sigmoid output), `nn.BCELoss`, two
Adam optimizers, real points from a DataLoader, alternating D and G updates.

    python gan_bce.py --max-iters 60
    python gan_bce.py --data points.csv      # real points from a CSV with columns x,y

How it fails: a `--data` CSV in which one point has a NaN coordinate. The discriminator's
output for that point is NaN, and `nn.BCELoss` refuses it ("all elements of input should be
between 0 and 1"): the script dies with a RuntimeError in the discriminator's loss of the
first batch that holds the point (non-finite data, the discriminator's step).
"""

from __future__ import annotations

import argparse
import csv
import math
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def eight_gaussians(n: int, g: torch.Generator) -> torch.Tensor:
    k = torch.randint(0, 8, (n,), generator=g)
    angle = k.float() * (2 * math.pi / 8)
    centres = torch.stack([angle.cos(), angle.sin()], dim=1) * 2.0
    return centres + 0.05 * torch.randn(n, 2, generator=g)


def load_points(path: str) -> torch.Tensor:
    with open(path, newline="") as f:
        rows = [(float(r["x"]), float(r["y"])) for r in csv.DictReader(f)]
    return torch.tensor(rows, dtype=torch.float32)


class Generator(nn.Module):
    def __init__(self, nz: int, hidden: int) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, hidden), nn.ReLU(True),
                                  nn.Linear(hidden, hidden), nn.ReLU(True),
                                  nn.Linear(hidden, 2))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.main = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(hidden, hidden), nn.LeakyReLU(0.2, inplace=True),
                                  nn.Linear(hidden, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x).view(-1)


def main() -> None:
    p = argparse.ArgumentParser(description="vanilla GAN on 2-D points")
    p.add_argument("--data", default=None, help="CSV of real points (columns x,y)")
    p.add_argument("--n-points", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--nz", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--d-lr", type=float, default=2e-4)
    p.add_argument("--g-lr", type=float, default=2e-4)
    p.add_argument("--beta1", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=60)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=999)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    real_points = load_points(args.data) if args.data else eight_gaussians(args.n_points, g)
    loader = DataLoader(TensorDataset(real_points), batch_size=args.batch_size, shuffle=True,
                        generator=g, drop_last=True)

    netG = Generator(args.nz, args.hidden)
    netD = Discriminator(args.hidden)
    criterion = nn.BCELoss()
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.d_lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.g_lr, betas=(args.beta1, 0.999))
    real_label, fake_label = 1.0, 0.0

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([netD], [optimizerD])  # the discriminator's steps

    iters = 0
    for epoch in range(args.epochs):
        for i, (real,) in enumerate(loader):
            if iters >= args.max_iters:
                break
            ############################
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            ###########################
            if tracer:
                tracer.start(real)
            netD.zero_grad()
            b_size = real.size(0)
            label = torch.full((b_size,), real_label)
            output = netD(real)
            errD_real = criterion(output, label)
            errD_real.backward()
            D_x = output.mean().item()

            noise = torch.randn(b_size, args.nz)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            errD_fake.backward()
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            if tracer:
                tracer.loss(errD)
                tracer.grads()
            optimizerD.step()
            if tracer:
                tracer.updated()

            ############################
            # (2) Update G network: maximize log(D(G(z)))
            ###########################
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            errG.backward()
            D_G_z2 = output.mean().item()
            optimizerG.step()

            if iters % args.log_every == 0:
                print(f"[{epoch}/{args.epochs}][{i}/{len(loader)}] Loss_D: {errD.item():.4f} "
                      f"Loss_G: {errG.item():.4f} D(x): {D_x:.4f} "
                      f"D(G(z)): {D_G_z1:.4f} / {D_G_z2:.4f}")
            iters += 1
        if iters >= args.max_iters:
            break
    with torch.no_grad():
        samples = netG(torch.randn(512, args.nz))
    print(f"done: {iters} iterations; samples mean radius "
          f"{samples.norm(dim=1).mean().item():.3f}")


if __name__ == "__main__":
    main()
