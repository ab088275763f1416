"""No false alarms on a healthy GAN from its first step (DESIGN.md section 5, "false alarms").

A two-network GAN on a 2-D Gaussian mixture at the usual DCGAN-style settings (Adam 2e-4,
betas (0.5, 0.999), BCE on logits), 10 seeds, 300 steps, one guard per optimizer. The
discriminator's loss falls to ~1e-3 on some seeds and wanders by large ratios: ratio tests
need floors on the loss's own scale. Every guard must end `healthy` with no alarm.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig


def _gan(seed: int) -> tuple[list[Guard], list[float]]:
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 2))
    disc = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                         nn.LeakyReLU(0.2), nn.Linear(64, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    cfg = GuardConfig(record=RecordConfig(out="", summary=False))
    g_guard = Guard(gen, opt_g, config=cfg, activations=True)
    d_guard = Guard(disc, opt_d, config=cfg, activations=True)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    d_losses = []
    for _ in range(300):
        real = centers[torch.randint(0, 4, (64,), generator=g)] + 0.1 * torch.randn(
            64, 2, generator=g)
        fake = gen(torch.randn(64, 8, generator=g))
        d_loss = bce(disc(real), torch.ones(64, 1)) + bce(disc(fake.detach()),
                                                          torch.zeros(64, 1))
        d_guard.watch(loss=d_loss, batch=real)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = bce(disc(fake), torch.ones(64, 1))
        g_guard.watch(loss=g_loss)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        d_losses.append(d_loss.item())
    g_guard.close()
    d_guard.close()
    return [g_guard, d_guard], d_losses


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_healthy_gan_raises_no_alarm(seed: int) -> None:
    guards, d_losses = _gan(seed)
    assert all(math.isfinite(v) for v in d_losses)
    for guard in guards:
        report = guard.report
        assert report is not None
        assert report.alarms == [], report.alarms
        assert report.status == "healthy"
