"""A plain PyTorch training script that ends in `loss: nan`, the failure nanguard was built for.

An MLP (LeakyReLU 0.01) regresses a linear target with SGD, momentum 0.9, lr 0.05. At step 10
one sample of the batch is 25x larger than the rest: a gradient spike that momentum feeds back
until float32 overflows. Nothing here imports nanguard.

Run: python examples/train.py               (the losses, then inf, then nan)
     nanguard run examples/train.py         (the same, with nanguard's warnings and its finding)
     nanguard run examples/train.py --lr 0.005   (the script's own arguments go after it)
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
parser.add_argument("--steps", type=int, default=30, help="optimizer steps (default 30)")
args = parser.parse_args()

torch.manual_seed(1)
model = nn.Sequential(
    nn.Linear(16, 64), nn.LeakyReLU(0.01),
    nn.Linear(64, 64), nn.LeakyReLU(0.01),
    nn.Linear(64, 1),
)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
target = torch.randn(16, 1) / 4

for step in range(args.steps):
    x = torch.randn(32, 16)
    if step == 10:
        x[0] *= 25  # one outlier sample, as a real data set sometimes holds
    y = x @ target + 0.1 * torch.randn(32, 1)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step:3d}  loss {loss.item():.4g}")
