"""`skip` decided on the device with a fused optimizer's `found_inf` flag: no host read before
the update, the same end state as dropping the bad batches, the same record as a host skip."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, NanguardError, RecordConfig
from nanguard.config import RecoverConfig

BAD = (3, 6)


def _batches(n: int = 10, bad: tuple[int, ...] = BAD) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        if k in bad:
            x[5, 2] = math.nan
        out.append((x, y))
    return out


def _train(opt_name: str, guard_on: bool, tmp: Path, drop_bad: bool = False, max_skips: int = 10,
           bad: tuple[int, ...] = BAD) -> tuple[list[torch.Tensor], Guard | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt: torch.optim.Optimizer
    if opt_name == "adamw_fused":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    elif opt_name == "sgd_fused":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = None
    if guard_on:
        cfg = GuardConfig(policy="skip", act_on=("nonfinite",),
                          recover=RecoverConfig(max_consecutive_skips=max_skips),
                          record=RecordConfig(summary=False))
        guard = Guard(model, opt, out=tmp / opt_name, config=cfg)
    for k, (x, y) in enumerate(_batches(bad=bad)):
        if drop_bad and k in bad:
            continue
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], guard


@pytest.mark.parametrize("opt_name", ["adamw_fused", "sgd_fused"])
def test_device_skip_equals_dropping_the_bad_batches(tmp_path: Path, opt_name: str) -> None:
    expected, _ = _train(opt_name, False, tmp_path, drop_bad=True)
    got, guard = _train(opt_name, True, tmp_path)
    assert guard is not None
    report = guard.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    skips = [a for a in report.actions if a["action"] == "skip"]
    assert [a["step"] for a in skips] == list(BAD)
    assert all("on the device" in a["detail"] for a in skips)
    # One read per step, after the update: nothing read before it.
    assert guard.host_reads == 10
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == BAD[0]
    # The flag is gone after each step: no later step is skipped by a stale flag.
    assert "found_inf" not in guard.optimizer.__dict__


def test_a_plain_optimizer_skips_on_the_host(tmp_path: Path) -> None:
    expected, _ = _train("adamw", False, tmp_path, drop_bad=True)
    got, guard = _train("adamw", True, tmp_path)
    assert guard is not None
    report = guard.close()
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    skips = [a for a in report.actions if a["action"] == "skip"]
    assert [a["step"] for a in skips] == list(BAD)
    assert not any("on the device" in a["detail"] for a in skips)


def test_device_skip_gives_up_after_the_limit(tmp_path: Path) -> None:
    with pytest.raises(NanguardError, match="skipping does not heal"):
        _train("adamw_fused", True, tmp_path, max_skips=2, bad=(2, 3, 4, 5))
