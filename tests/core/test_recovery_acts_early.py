"""Recovery acts on what it sees: `skip` and `rollback` act on the early warnings by default
(a spike's update is discarded before it lands; a cascade is rolled back), the LR is backed
off only as far as the evidence calls for (tests/recover/test_recover_backoff.py), `skip` never
loops (it escalates to a stop), and the report says what recovery cost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig
from nanguard.config import default_act_on
from nanguard.scenarios import train_cascade


def test_default_act_on_follows_the_policy() -> None:
    assert GuardConfig(policy="observe").acting_on == ("nonfinite",)
    assert GuardConfig(policy="raise").acting_on == ("nonfinite",)
    for policy in ("skip", "rollback"):
        assert {"spike", "cascade", "forecast", "overflow"} <= set(default_act_on(policy))
    assert GuardConfig(policy="rollback", act_on=("nonfinite",)).acting_on == ("nonfinite",)


def test_rollback_discards_a_spike_before_it_lands(tmp_path: Path) -> None:
    """Seed 8 of the cascade: the outlier's spike is discarded (a `skip` action, no rollback,
    LR unchanged) and the run ends finite and `recovered`-or-better, with the cost reported."""
    guards: list[nanguard.Guard] = []

    def factory(model: nn.Module, optimizer: torch.optim.Optimizer) -> nanguard.Guard:
        guards.append(nanguard.Guard(model, optimizer, policy="rollback", out=tmp_path / "r",
                                     config=GuardConfig(record=RecordConfig(summary=False))))
        return guards[0]

    setup, losses = train_cascade(8, factory, steps=120)
    report = guards[0].report
    assert report is not None
    kinds = [a["action"] for a in report.actions]
    assert "skip" in kinds and "give_up" not in kinds, report.actions
    assert all(torch.isfinite(p).all() for p in setup.model.parameters())
    assert losses[-1] < 0.1
    skip = next(a for a in report.actions if a["action"] == "skip")
    assert "spike" in skip["detail"] and "no rollback needed" in skip["detail"]
    assert report.status == "recovered"
    verdict = report.run["recovery"]
    assert verdict["back"] is True and verdict["updates_skipped"] >= 1
    assert verdict["lr_factor"] == 1.0 and verdict["snapshot_bytes"] > 0


def test_skip_escalates_instead_of_looping(tmp_path: Path) -> None:
    """Parameters already NaN: every later step is bad; `skip` stops after the limit."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = GuardConfig(policy="skip", record=RecordConfig(summary=False))
    cfg.recover.max_consecutive_skips = 4
    guard = nanguard.Guard(model, opt, out=tmp_path / "r", config=cfg)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(nanguard.NanguardError, match="skipping does not heal"):
        for _ in range(20):
            loss = model(torch.randn(8, 4)).pow(2).mean()
            guard.watch(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = guard.report
    assert report is not None and report.status == "failed"
    kinds = [a["action"] for a in report.actions]
    assert kinds == ["skip"] * 4 + ["give_up"]
    assert report.run["ended"]["how"] == "stopped"
