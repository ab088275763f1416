"""A GAN whose discriminator ends in Sigmoid, trained with a hand-written binary cross-entropy
`-(y log p + (1 - y) log(1 - p))` at far too high a learning rate (SGD, lr 3). The
discriminator saturates: p rounds to exactly 1.0 in float32 and `log(1 - p)` is -inf, at
`aten.log` in the loss phase. `build()` trains up to the failing iteration and hands it back
(a D step then a G step, two optimizers in one closure).

`F.binary_cross_entropy` itself clamps its logs at -100, so with it the same run does not go
NaN: it stalls, the loss pinned at exactly 100 and the sigmoid's gradient exactly 0.
"""

import math

import torch
from torch import nn

from . import Built

LR = 3.0
EXPECTED = {"phase": "loss", "module": None, "op": "aten.log", "samples": None,
            "cause": "saturated_loss"}


class Gan(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))
        self.D = nn.Sequential(nn.Linear(2, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1),
                               nn.Sigmoid())


def _setup(seed: int = 0):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    gan = Gan()
    opt_d = torch.optim.SGD(gan.D.parameters(), lr=LR)
    opt_g = torch.optim.SGD(gan.G.parameters(), lr=LR)
    return gan, opt_d, opt_g


def bce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()  # should be BCE-with-logits


def _iteration(gan: Gan, opt_d: torch.optim.Optimizer, opt_g: torch.optim.Optimizer,
               real: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
    opt_d.zero_grad()
    fake = gan.G(z)
    loss_d = bce(gan.D(real), ones) + bce(
        gan.D(fake.detach()), zeros)
    loss_d.backward()
    opt_d.step()
    opt_g.zero_grad()
    loss_g = bce(gan.D(fake), ones)
    loss_g.backward()
    opt_g.step()
    return (loss_d + loss_g).detach()


def _data(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    real = torch.randn(16, 2, generator=g) * 0.5 + torch.tensor([30.0, -30.0])
    return real, torch.randn(16, 4, generator=g)


def first_nonfinite_iteration(max_iter: int = 200) -> int:
    gan, opt_d, opt_g = _setup()
    for i in range(max_iter):
        loss = _iteration(gan, opt_d, opt_g, *_data(i))
        ok = all(bool(p.isfinite().all()) for p in gan.parameters())
        if not math.isfinite(loss.item()) or not ok:
            return i
    raise AssertionError("the GAN did not fail")


def build() -> Built:
    n = first_nonfinite_iteration()
    gan, opt_d, opt_g = _setup()
    for i in range(n):
        _iteration(gan, opt_d, opt_g, *_data(i))
    real, z = _data(n)
    return Built(model=gan, optimizer=opt_d, batch=(real, z),
                 step=lambda: _iteration(gan, opt_d, opt_g, real, z),
                 notes={"iteration": n, "optimizers": [opt_d, opt_g]})
