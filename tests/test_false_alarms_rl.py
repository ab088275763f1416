"""No loss-trend alarm on a non-stationary objective (issue 37 item 6, `detect.objective`).

- A healthy on-policy PPO (`tests/programs/scripts/ppo_cartpole.py`: a rollout of the current
  policy each iteration, a few epochs of minibatches over it; the value loss grows and jumps
  with the returns). The script's own prints show the loss is not stationary: an iteration's
  mean loss several times the one before. Under `nanguard run` it ends `healthy` with no
  alarm and says why its loss-trend alarms are off (a `loss_trend_off` action naming the
  rollout buffer). With `--objective stationary` the same run alarms on its loss (the control
  is not vacuous).
- A healthy GAN (`gan_bce.py`, two optimizers, two guards): `healthy`, no alarm, the peer named.
- The other side, in process on real tiny training: a supervised epoch loop over a small
  shuffled dataset (rows reused from the second epoch on, none new) and a random-crop loader
  (no row ever reused) keep their loss-trend alarms; a gradient spike is still an alarm with
  the objective set non-stationary.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.cli.main import main
from nanguard.config import DetectConfig
from nanguard.record.report import load_report
from nanguard.show.summary import report_spike_line

sys.path.insert(0, str(Path(__file__).resolve().parent / "programs"))
from programs_support import guarded  # noqa: E402

PPO = ("ppo_cartpole.py", "--iterations", "30")


def test_healthy_ppo_and_gan_raise_no_alarm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dirs = [tmp_path / d for d in ("ppo", "control", "gan")]
    for d in dirs:
        d.mkdir()
    # One after the other, in this process (`guarded`: the command's `main`, which owns the
    # process's hooks while it runs).
    ppo_run = guarded(dirs[0], *PPO)
    control_run = guarded(dirs[1], *PPO, options=("--objective", "stationary"))
    gan_run = guarded(dirs[2], "gan_bce.py", "--max-iters", "300")
    means = [float(m) for m in re.findall(r"ITER \d+ loss ([\d.]+)", ppo_run.proc.stdout)]
    assert len(means) == 30
    assert max(b / a for a, b in zip(means, means[1:], strict=False)) > 3  # not stationary
    rep = ppo_run.report
    assert rep["status"] == "healthy" and not rep["alarms"], ppo_run.explain()
    off = [a for a in rep["actions"] if a["action"] == "loss_trend_off"]
    # Said once, when it first mattered: at the first loss-trend alarm it kept from being raised.
    assert len(off) == 1 and "rollout buffer" in off[0]["detail"]
    # Nor does the summary count the value loss's growth as spike episodes.
    line = report_spike_line(load_report(ppo_run.out))
    assert line is not None and "episode" not in line and "not a stationary" in line, line
    control = report_spike_line(load_report(control_run.out))
    assert control is not None and "episode" in control, control
    # The same run, its loss taken as stationary: the loss-trend detectors fire.
    kinds = {(a["kind"], a["signal"]) for a in control_run.report["alarms"]}
    assert kinds & {("divergence", "loss"), ("spike", "loss")}, control_run.explain()
    rep = gan_run.report
    assert rep["status"] == "healthy" and not rep["alarms"], gan_run.explain()
    # `nanguard report` of the merged run shows each part's last steps, labelled, as the
    # closing summary did (it showed one part's, unlabelled).
    live = set(re.findall(r"(optimizer-\d) \(", gan_run.proc.stderr))
    assert len(live) == 2, gan_run.proc.stderr[-2000:]
    capsys.readouterr()
    assert main(["report", str(gan_run.out)]) == 0
    assert set(re.findall(r"(optimizer-\d) \(", capsys.readouterr().out)) == live
    # Decided only when a loss-trend alarm would have fired; when it was, the peer is why.
    assert all("another model" in a["detail"] for a in rep["actions"]
               if a["action"] == "loss_trend_off")


def _supervised(loader: str, objective: str = "auto", jump_at: int | None = None):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = torch.randn(2000, 8, generator=g)
    target = data @ torch.randn(8, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, config=GuardConfig(
        record=RecordConfig(out="", summary=False), detect=DetectConfig(objective=objective)))
    for step in range(120):
        if loader == "epochs":  # 128 rows, 4 batches an epoch, reshuffled each epoch
            if step % 4 == 0:
                perm = torch.randperm(128, generator=g)
            idx = perm[(step % 4) * 32:(step % 4 + 1) * 32]
        else:  # random rows of a large pool: hardly any reused
            idx = torch.randint(0, 2000, (32,), generator=g)
        x, y = data[idx], target[idx]
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        if step == jump_at:
            for p in model.parameters():
                p.grad.mul_(1000)
        opt.step()
    return guard.close(), guard


def test_supervised_loaders_keep_their_loss_trend_alarms() -> None:
    for loader in ("epochs", "random"):
        report, guard = _supervised(loader)
        assert not [a for a in report.actions if a["action"] == "loss_trend_off"], loader
        assert not any(getattr(d, "nonstationary", False) for d in guard.detectors)


def test_gradient_alarms_keep_watching_a_nonstationary_objective() -> None:
    report, guard = _supervised("random", objective="nonstationary", jump_at=80)
    assert all(d.nonstationary for d in guard.detectors if hasattr(d, "nonstationary"))
    assert [(a["step"], a["signal"]) for a in report.alarms
            if a["kind"] == "spike"] == [(80, "grad_norm")]


def test_a_guard_left_open_is_no_peer() -> None:
    # An earlier experiment's guard, never closed and no longer stepping, does not make the
    # next run's loss "coupled" to it.
    old = nn.Linear(8, 1)
    opt = torch.optim.SGD(old.parameters(), lr=1e-2)
    left = Guard(old, opt, config=GuardConfig(record=RecordConfig(out="", summary=False)))
    for _ in range(3):
        loss = old(torch.randn(4, 8)).pow(2).mean()
        left.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    report, _ = _supervised("random")
    assert not [a for a in report.actions if a["action"] == "loss_trend_off"]
    left.close()
