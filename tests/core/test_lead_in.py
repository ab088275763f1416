"""report.json's `first_warning` is the first warning of the failure: the run of alarms that
led into the first non-finite value, not only those of its last `lead_window` steps."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import nanguard
from nanguard.record.lead import lead_in
from nanguard.record.report import build_report


def _alarm(step: int, kind: str = "divergence") -> dict[str, object]:
    return {"step": step, "kind": kind, "signal": "loss", "value": 1.0, "message": ""}


def test_warnings_that_kept_coming_all_lead_into_the_failure() -> None:
    # Warnings every 2 steps from step 2, the NaN at 18 (makemore at --learning-rate 1000).
    alarms = [_alarm(s) for s in range(2, 17, 2)] + [_alarm(18, "nonfinite")]
    report = build_report(steps=20, alarms=alarms, actions=[], lead_window=10,
                          first_nonfinite={"step": 18})
    assert (report.first_warning, report.lead_steps) == (2, 16)


def test_a_spike_long_before_with_quiet_steps_between_is_not_a_warning_of_it() -> None:
    alarms = [_alarm(40, "spike"), _alarm(495), _alarm(499), _alarm(500, "nonfinite")]
    report = build_report(steps=501, alarms=alarms, actions=[], lead_window=10,
                          first_nonfinite={"step": 500})
    assert (report.first_warning, report.lead_steps) == (495, 5)
    assert lead_in([40], 500, 10) is None  # nothing within the window: no warning
    assert lead_in([489, 500], 500, 10) is None  # a gap of 11 breaks the run; same step: none
    assert lead_in([491, 500], 500, 10) == 491  # the same-step alarm is no link of the run


def test_a_diverging_run_reports_the_warning_that_came_first(tmp_path: Path) -> None:
    """A real run: least squares at an LR above its stability limit. Its own losses grow
    from the first steps (checked here, without nanguard); the guard warned from then on."""
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.2)
    guard = nanguard.Guard(model, opt, out=tmp_path / "run")
    losses = []
    for _ in range(400):
        i = torch.randint(0, 256, (32,))
        loss = torch.nn.functional.mse_loss(model(x[i]), y[i])
        guard.watch(loss=loss, batch=(x[i], y[i]))
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if not torch.isfinite(loss):
            break
    report = guard.close()
    assert report.first_nonfinite is not None
    nf = report.first_nonfinite["step"]
    assert nf > 30 and losses[10] > 100 * losses[0]  # diverging well before the NaN
    warned = sorted(a["step"] for a in report.alarms if a["kind"] != "nonfinite")
    assert report.first_warning == warned[0] < 10
    assert report.lead_steps == nf - warned[0] > 30
    # The diagnosis counts the same warnings: its evidence starts where they started, not
    # at the last 10 steps before the NaN.
    why = report.diagnosis[0]["evidence"]
    found = re.search(r"alarms from step (\d+)", why)
    assert report.diagnosis[0]["cause"] == "optimizer_divergence" and found, why
    assert int(found.group(1)) < 10, why
