"""The decided watch set (DESIGN section 8, issue 39): the optimizer state is sampled, the rest
is measured every step, and nothing found from the every-step signals changes.

Differential: the same seeded cascade runs (SGD momentum, LR too high: spikes, cascades, then
NaN) with the optimizer state measured every step (`sample_every=1`) and sampled (the
default), compared alarm by alarm (all but those of `momentum_norm`, a sampled signal) and by
their first non-finite step, phase, signals and parameter: the state that went bad with the
parameters is still named at their step. Which steps measured the state is checked against
the schedule (every k steps, every step of an alarm episode, the step after a checkpoint save,
close) computed here from the steps and alarms, and report.json's `sampling` against it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig, WatchConfig
from nanguard.cli.main import main
from nanguard.scenarios.cascade import make_cascade, step_loss


def _cascade(seed: int, every: int, out: Path) -> tuple[Guard, dict[str, Any]]:
    setup = make_cascade(seed)
    guard = Guard(setup.model, setup.optimizer, config=GuardConfig(
        record=RecordConfig(out=str(out), summary=False),
        watch=WatchConfig(sample_every=every)))
    for x, y in setup.batches:
        loss = step_loss(setup.model, setup.loss_fn, (x, y))
        guard.watch(loss=loss, batch=(x, y))
        setup.optimizer.zero_grad()
        loss.backward()
        setup.optimizer.step()
    report = guard.close().to_dict()
    return guard, report


def _every_step_alarms(report: dict[str, Any]) -> list[tuple[int, str, str]]:
    return [(a["step"], a["kind"], a["signal"]) for a in report["alarms"]
            if a["signal"] != "momentum_norm"]


def _found(report: dict[str, Any]) -> tuple[Any, ...]:
    f = report["first_nonfinite"]
    return (f["step"], f["phase"], f["module"], f["param"], f["signals"])


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_keeps_what_the_every_step_signals_find(seed: int, tmp_path: Path) -> None:
    _, whole = _cascade(seed, 1, tmp_path / "every")
    guard, sampled = _cascade(seed, 10, tmp_path / "sampled")
    assert whole["status"] == sampled["status"] == "failed"
    assert _every_step_alarms(sampled) == _every_step_alarms(whole)
    assert _found(sampled) == _found(whole)
    # (Where the parameters went bad with the momentum buffer, the buffer is named at their
    # step: measured then, a sampled step or not.)

    # Which steps measured the state: the schedule, computed from the steps and alarms.
    alarmed = sorted({a["step"] for a in sampled["alarms"]})
    found = sampled["first_nonfinite"]["step"]
    steps = [s.step for s in guard.history]  # kept up to the step after the first NaN
    measured = [s.step for s in guard.history if s.state_norms]
    want = [s for s in steps if s % 10 == 0 or s == found
            or any(0 < s - a <= 10 for a in alarmed if a < s)]
    assert measured == want
    info = sampled["sampling"]
    assert info["every"] == 10 and info["signals"]["optimizer_state"] == 10
    assert info["signals"]["update_ratio"] == 10 and info["signals"]["activations"] is None
    assert {"loss", "grad_norms", "param_norms"} <= set(info["every_step"])
    assert info["state_why"]["stride"] == math.ceil(sampled["steps"] / 10)
    assert info["state_why"]["alarm"] > 0 and info["state_why"]["nonfinite"] <= 1
    assert info["state_steps"] == sum(info["state_why"].values())
    assert whole["sampling"]["state_why"]["stride"] == whole["steps"]


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, guard: Guard, steps: range,
           save_after: int | None = None) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    saved = []
    for i in steps:
        x = torch.randn(16, 8, generator=g)
        loss = model(x).pow(2).mean()
        guard.watch(loss=loss, batch=x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if i == save_after:
            saved.append(guard.state_dict())  # a checkpoint save the guard sees
    return saved


def test_a_save_samples_the_next_step_and_close_measures_the_last(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, opt = _mlp()
    guard = Guard(model, opt, config=GuardConfig(record=RecordConfig(out=str(tmp_path),
                                                                   summary=False)))
    _steps(model, opt, guard, range(25), save_after=13)
    report = guard.close()
    measured = [s.step for s in guard.history if s.state_norms]
    assert measured == [0, 10, 14, 20]
    assert report.status == "healthy"
    assert report.sampling is not None
    assert report.sampling["state_why"] == {"stride": 3, "alarm": 0, "save": 1, "nonfinite": 0,
                                            "close": 1}
    capsys.readouterr()
    assert main(["report", str(tmp_path), "--full"]) == 0
    printed = " ".join("".join(capsys.readouterr()).split())
    assert ("sampled: optimizer state every 10 steps (+ 2 more: save 1, close 1); update ratio "
            "every 10 steps; every step: loss, grad_norms, param_norms") in printed


def test_a_state_gone_inf_between_samples_is_found_at_close(tmp_path: Path) -> None:
    # An `exp_avg_sq` at inf zeroes its updates and leaves the parameters finite: no
    # every-step signal shows it; the measurement at close does, at the last step.
    model, opt = _mlp()
    guard = Guard(model, opt, config=GuardConfig(record=RecordConfig(out=str(tmp_path),
                                                                   summary=False)))
    _steps(model, opt, guard, range(15))
    with torch.no_grad():
        opt.state[model[2].weight]["exp_avg_sq"][0, 3] = float("inf")
    report = guard.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert report.status == "failed"
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["step"] == 14
    assert report.first_nonfinite["signals"] == ["optimizer.exp_avg_sq"]
    assert report.first_nonfinite["param"] == "2.weight"
    assert report.sampling is not None and report.sampling["state_why"]["close"] == 1
