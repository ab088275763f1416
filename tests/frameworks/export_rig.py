"""A small guarded run with a NaN row at step BAD under `skip`: what every exporter test writes
and reads back (the NaN loss at BAD, the nonfinite/skipped markers 1.0 there only, the alarm,
action and finding at BAD)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig

BAD = 3
STEPS = 8


def nan_run(out: Path):
    """Train 8 steps of a tiny MLP with a NaN input row at step BAD; returns the guard's report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, policy="skip", out=out,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if step == BAD:
            x[5, 1] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = guard.close()
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == BAD
    return report


def check_series(loss: dict[int, float], nonfinite: dict[int, float],
                 skipped: dict[int, float]) -> None:
    """The NaN loss is at BAD (not dropped, not replaced), every other step finite, and the 0/1
    markers are 1.0 at BAD only."""
    assert sorted(loss) == list(range(STEPS)), loss
    assert math.isnan(loss[BAD]), loss
    assert all(math.isfinite(v) for s, v in loss.items() if s != BAD), loss
    assert sorted(nonfinite) == list(range(STEPS))
    assert [s for s, v in sorted(nonfinite.items()) if v == 1.0] == [BAD], nonfinite
    assert [s for s, v in sorted(skipped.items()) if v == 1.0] == [BAD], skipped


def check_events(texts: dict[tuple[int, str], str]) -> None:
    """(step, kind) -> text: the alarm, skip, finding and diagnosis sit at BAD, the report last."""
    assert "nonfinite" in texts[(BAD, "alarms")]
    assert "skip" in texts[(BAD, "actions")]
    assert "data" in texts[(BAD, "first_nonfinite")]
    assert "data_nonfinite" in texts[(BAD, "diagnosis")]
    assert "status: " in texts[(STEPS - 1, "report")]
    assert [k for k in texts if k[1] == "actions"] == [(BAD, "actions")]
