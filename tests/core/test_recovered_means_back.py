"""`recovered` means the model is back: after a skip or rollback, the loss of the last steps
must return to its level before the failure; a run that goes on finite but far worse is
`failed` (run.recovery says why)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard


def _train(out: Path, target_scale: float, plant: str,
           config: nanguard.GuardConfig | None = None) -> nanguard.Report:
    """120 steps of a tiny regression under `skip`; at step 60 a NaN input (`plant` "nan") or
    a wild target ("spike"); after it the targets are the same task (`target_scale` 1) or one
    the model cannot reach."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 1, generator=g)
    with nanguard.Guard(model, opt, policy="skip", out=out, config=config) as guard:
        for step in range(120):
            x = torch.randn(32, 4, generator=g)
            y = x @ w
            if step == 60 and plant == "nan":
                x[3, 1] = float("nan")  # one bad row: skipped
            if step == 60 and plant == "spike":
                y[3] += 300.0  # one wild target: a bad batch, its update discarded
            if step > 60:
                y = y * target_scale + (target_scale - 1.0) * 10.0
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.report is not None
    return guard.report


@pytest.mark.parametrize(("target_scale", "status"), [(1.0, "recovered"), (30.0, "failed")])
def test_recovered_only_when_the_loss_is_back(tmp_path: Path, target_scale: float,
                                              status: str) -> None:
    # Acting on non-finite values only: the verdict, not the early warnings, is under test.
    report = _train(tmp_path / "r", target_scale, "nan",
                    nanguard.GuardConfig(act_on=("nonfinite",)))
    assert [a["action"] for a in report.actions] == ["skip"]
    assert report.status == status, report.run.get("recovery")
    verdict = report.run["recovery"]
    assert verdict["back"] is (status == "recovered")
    assert verdict["loss_before"] is not None and verdict["loss_end"] is not None


@pytest.mark.parametrize(("target_scale", "status"), [(1.0, "recovered"), (30.0, "warned")])
def test_acting_on_a_warning_is_recovered_only_when_the_loss_is_back(
        tmp_path: Path, target_scale: float, status: str) -> None:
    """No non-finite value: skip discards a bad batch's update, then the task moves out of
    the model's reach. The loss does not come back, so the run is not `recovered` (it was,
    with `run.recovery.back` False beside it); nothing was non-finite, so not `failed`."""
    report = _train(tmp_path / "r", target_scale, "spike")
    assert report.first_nonfinite is None
    assert [a["action"] for a in report.actions][:1] == ["skip"], report.actions
    assert report.run["recovery"]["back"] is (status == "recovered")
    assert report.status == status
