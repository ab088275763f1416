"""A small regression trained with a DataLoader; --flip-at K flips the top mantissa bit of one
element of the first layer's output at step K (a one-off in-range fault)."""
import argparse

import torch
from torch import nn

from nanguard.testing import FaultInjector

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=24)
p.add_argument("--flip-at", type=int, default=-1)
a = p.parse_args()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(a.steps * 32, 8)
y = x[:, :2].sum(1, keepdim=True)
dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
with FaultInjector(model, opt, seed=3) as inj:
    if a.flip_at >= 0:
        inj.flip_activation("0", step=a.flip_at, bit=22)
    for xb, yb in dl:
        loss = nn.functional.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
print("final loss", float(loss.detach()))
