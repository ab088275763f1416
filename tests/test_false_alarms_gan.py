"""No false alarms on a healthy GAN from its first step (DESIGN.md section 5, "false alarms").

A two-network GAN on a 2-D Gaussian mixture at the usual DCGAN-style settings (Adam 2e-4,
betas (0.5, 0.999), BCE on logits), 10 seeds, 300 steps, one guard per optimizer. The
discriminator's loss falls to ~1e-3 on some seeds and wanders by large ratios: ratio tests
need floors on the loss's own scale. Every guard must end `healthy` with no alarm.

The same 10 seeds run with a constant LR, a linear warm-up (30 steps from ~0, then constant)
and a cosine decay to 0 over the run (no warm-up): the first steps of a warm-up (a tiny LR, then
a growing one) must not read as growth, nor the end of a cosine as vanishing.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig

STEPS = 300
WARMUP = 30


def _schedule(name: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR | None:
    if name == "constant":
        return None
    if name == "warmup":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / WARMUP))
    return torch.optim.lr_scheduler.LambdaLR(  # cosine
        opt, lambda i: 0.5 * (1.0 + math.cos(math.pi * min(i / STEPS, 1.0))))


def _gan(seed: int, schedule: str = "constant") -> tuple[list[Guard], list[float]]:
    torch.manual_seed(seed)
    gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                        nn.Linear(64, 2))
    disc = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 64),
                         nn.LeakyReLU(0.2), nn.Linear(64, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    cfg = GuardConfig(record=RecordConfig(out="", summary=False))
    sched_g, sched_d = _schedule(schedule, opt_g), _schedule(schedule, opt_d)
    g_guard = Guard(gen, opt_g, config=cfg, activations=True, scheduler=sched_g)
    d_guard = Guard(disc, opt_d, config=cfg, activations=True, scheduler=sched_d)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(seed)
    centers = torch.tensor([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.0], [0.0, -2.0]])
    d_losses = []
    for _ in range(STEPS):
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
        for sched in (sched_g, sched_d):
            if sched is not None:
                sched.step()
        d_losses.append(d_loss.item())
    g_guard.close()
    d_guard.close()
    return [g_guard, d_guard], d_losses


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("schedule", ["constant", "warmup", "cosine"])
def test_healthy_gan_raises_no_alarm(schedule: str, seed: int) -> None:
    guards, d_losses = _gan(seed, schedule)
    assert all(math.isfinite(v) for v in d_losses)
    for guard in guards:
        report = guard.report
        assert report is not None
        assert report.alarms == [], report.alarms
        assert report.status == "healthy"
