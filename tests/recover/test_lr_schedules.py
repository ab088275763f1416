"""A schedule's own rises are no LR jump: warm restarts and warm-ups from near 0.

PyTorch's `CosineAnnealingWarmRestarts` takes the LR from ~0 back to its base every period, and
a warm-up from a tiny start (`LinearLR(start_factor=1e-3)`, a per-epoch warm-up from 1e-6 as
timm's `warmup_lr_init` gives) rises 20-1000x in one step. Before, each was an `lr_jump`: a
healthy run ended `warned`, and `heal` ramped the LR over every restart (the SGDR run below
ended at a loss 50x plain's). A real jump (a run trained at one LR that goes 10x without
warm-up, a resume at a higher LR) is still one: tests/recover/test_lr_jump.py.

The runs are healthy by the plain run alone: its loss falls and never jumps.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard.policy.lr_change import LrChanges

STEPS, EPOCH, LR = 300, 40, 3e-3


def _scheduler(kind: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if kind == "sgdr":
        return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=60)
    if kind == "linear_from_1e-3":
        return torch.optim.lr_scheduler.LinearLR(opt, start_factor=1e-3, total_iters=50)
    assert kind == "epoch_warmup_from_1e-6"  # 1e-6, then a third of the way each epoch

    def factor(step: int) -> float:
        return (1e-6 + (LR - 1e-6) * min(step // EPOCH, 3) / 3) / LR

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _train(kind: str, policy: str | None, out: Path) -> tuple[list[float], nn.Module,
                                                              nanguard.Report | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    sched = _scheduler(kind, opt)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 1, generator=g)
    guard = None if policy is None else nanguard.Guard(
        model, opt, policy=policy, out=out,
        config=nanguard.GuardConfig(record=nanguard.RecordConfig(summary=False)))
    losses = []
    for _ in range(STEPS):
        x = torch.randn(32, 16, generator=g)
        y = x @ w + 0.1 * torch.randn(32, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses, model, None if guard is None else guard.close()


@pytest.mark.parametrize("kind", ["sgdr", "linear_from_1e-3", "epoch_warmup_from_1e-6"])
def test_a_schedules_own_rise_is_no_jump(tmp_path: Path, kind: str) -> None:
    plain, plain_model, _ = _train(kind, None, tmp_path / "plain")
    # Healthy by the plain run alone: the loss falls 100x, and no 10-step mean is 1.5x the
    # one before it (no spike, at the restarts either).
    assert sum(plain[-20:]) < 0.01 * sum(plain[:20])
    means = [sum(plain[i:i + 10]) / 10 for i in range(0, STEPS, 10)]
    assert all(b < 1.5 * a for a, b in pairwise(means))
    for policy in ("observe", "heal"):
        losses, model, report = _train(kind, policy, tmp_path / policy)
        assert report is not None
        assert report.status == "healthy", (policy, report.alarms, report.actions)
        assert not report.actions
        # Nothing changed the training: heal made no ramp over the schedule's rises.
        assert losses == plain
        for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_the_rules_on_lr_sequences() -> None:
    def jumps(lrs: dict[int, float], load: float | None = None) -> list[int]:
        c = LrChanges()
        if load is not None:
            c.load(load)
        return [step for step, lr in lrs.items() if c.see(step, lr) is not None]

    # A run trained at 1e-3 for 100 steps, then 10x: a jump.
    assert jumps({0: 1e-3, 100: 1e-2}) == [100]
    # A restart back to the run's first LR after a decay to ~0: none; above it: a jump.
    assert jumps({0: 1e-2, 50: 1e-4, 60: 1e-2}) == []
    assert jumps({0: 1e-2, 50: 1e-4, 60: 3e-2}) == [60]
    # A warm-up from near 0 in a fresh run: none, however many steps it held its start...
    assert jumps({0: 1e-6, 1000: 1e-3}) == []
    assert jumps({0: 1e-4, 1: 1e-3}) == []  # (10x after 1 step: nothing trained yet)
    # A constant LR held 40 steps, then 50x: a jump (spike_causes' `jump_held` at step 40).
    assert jumps({0: 1e-3, 40: 5e-2}) == [40]
    # ...but after a decay, or in a resumed run, the same rise is a jump.
    assert jumps({0: 1e-4, 100: 5e-5, 200: 1e-3}) == [200]
    assert jumps({0: 1e-4, 1: 1e-3}, load=1e-4) == [0 + 1]
    # A resume's first step is judged against the checkpoint's LR, even one the run had.
    c = LrChanges()
    c.see(0, 1e-2)
    c.see(100, 1e-4)
    c.load(1e-4)  # a checkpoint saved at the decayed LR
    jump = c.see(101, 1e-2)
    assert jump is not None and jump.resumed and jump.factor == pytest.approx(100)
