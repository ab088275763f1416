"""Coupled models roll back together: a GAN's generator and discriminator are trained on each
other's outputs, so when one rolls back the other must too (`Guard.couple`; `nanguard run`
couples every guard of a script)."""

from __future__ import annotations

import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig


def _gan(couple: bool) -> tuple[list[nanguard.Guard], nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3)
    cfg = GuardConfig(policy="rollback", act_on=("nonfinite",),
                      record=RecordConfig(out="", summary=False))
    cfg.recover.snapshot_every = 5
    cfg.recover.quiet_steps = 0
    g_guard = nanguard.Guard(gen, opt_g, config=cfg)
    d_guard = nanguard.Guard(disc, opt_d, config=cfg)
    if couple:
        d_guard.couple(g_guard)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(1)
    for step in range(40):
        real = torch.randn(32, 2, generator=g) + 2.0
        if step == 23:
            real[7, 0] = float("nan")
        fake = gen(torch.randn(32, 4, generator=g))
        d_loss = bce(disc(real), torch.ones(32, 1)) + bce(disc(fake.detach()), torch.zeros(32, 1))
        d_guard.watch(loss=d_loss, batch=real)
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        g_loss = bce(disc(fake), torch.ones(32, 1))
        g_guard.watch(loss=g_loss)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    g_guard.close()
    d_guard.close()
    return [g_guard, d_guard], gen, disc


def test_generator_rolls_back_with_the_discriminator() -> None:
    (g_guard, d_guard), gen, disc = _gan(couple=True)
    d_actions = [(a["step"], a["action"]) for a in d_guard.actions]
    g_actions = [(a["step"], a["action"]) for a in g_guard.actions]
    assert (23, "rollback") in d_actions, d_guard.actions
    # The generator went back too, in the same training step (its update of step 23, still
    # to come when the discriminator rolled back, discarded).
    assert (23, "rollback") in g_actions, g_guard.actions
    for p in [*gen.parameters(), *disc.parameters()]:
        assert torch.isfinite(p).all()


def test_uncoupled_generator_stays() -> None:
    (g_guard, d_guard), _, _ = _gan(couple=False)
    assert any(a["action"] == "rollback" for a in d_guard.actions)
    assert not any(a["action"] == "rollback" for a in g_guard.actions)
