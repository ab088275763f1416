"""`DetectConfig.rerun_every`: the opt-in re-run of quiet steps catches a transient fault that
leaves every value in range (no detector of values can see it), names the step and ends
diagnosed `nondeterministic`; on a healthy run it raises nothing and changes nothing, bit for
bit; a step with another alarm is not re-run twice."""

from __future__ import annotations

import hashlib

import pytest
import torch
from torch import nn

from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig
from nanguard.testing import FaultInjector

STEPS = 24
K = 15  # the flip's step: quiet, past the detectors' warm-up


def _train(tmp_path, *, rerun_every: int | None, flip: bool):
    """A small MLP on a fixed regression, SGD with momentum, a low mantissa-side flip of one
    element of the first layer's output at step K (the value stays in range). `rerun_every`
    None: no Guard at all. Returns (weights' hash, the guard's report or None, the flip)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(256, 8)
    y = x[:, :2].sum(1, keepdim=True)

    def replay(batch):
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = None
    if rerun_every is not None:
        cfg = GuardConfig(record=RecordConfig(out=str(tmp_path / f"run{rerun_every}{flip}"),
                                              summary=False),
                          detect=DetectConfig(rerun_every=rerun_every))
        guard = Guard(model, opt, config=cfg, replay=replay)
    planned = None
    with FaultInjector(model, opt, seed=3) as inj:
        if flip:
            planned = inj.flip_activation("0", step=K, bit=22)  # the top mantissa bit
        for step in range(STEPS):
            i = (step * 32) % 256
            xb, yb = x[i:i + 32], y[i:i + 32]
            loss = nn.functional.mse_loss(model(xb), yb)
            if guard is not None:
                guard.watch(loss=loss, batch=(xb, yb))
            opt.zero_grad()
            loss.backward()
            opt.step()
    report = guard.close() if guard is not None else None
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in model.parameters())).hexdigest()
    return digest, report, planned


def test_an_in_range_flip_is_caught_by_the_sampled_rerun(tmp_path):
    _, plain_report, flip = _train(tmp_path, rerun_every=0, flip=True)
    assert flip is not None and flip.fired and flip.step == K
    # The flipped element stays in range: no detector of values alarms (independent check:
    # the value it became is finite and small).
    assert abs(flip.new) < 10 and plain_report.alarms == []
    _, report, flip = _train(tmp_path, rerun_every=1, flip=True)
    [alarm] = [a for a in report.alarms if a["kind"] == "rerun_mismatch"]
    assert alarm["step"] == K and "suspect the hardware" in alarm["message"]
    [entry] = [s for s in report.spikes if s["step"] == K]
    assert entry["rerun"]["verdict"] == "transient" and entry["alarm"] == "rerun_mismatch"
    assert report.status == "warned"
    assert report.diagnosis[0]["cause"] == "nondeterministic"


def test_healthy_run_is_unchanged_and_quiet(tmp_path):
    plain, _, _ = _train(tmp_path, rerun_every=None, flip=False)
    watched, report, _ = _train(tmp_path, rerun_every=1, flip=False)
    assert watched == plain  # re-running every step changed nothing, bit for bit
    assert report.alarms == [] and report.status == "healthy"


def test_a_negative_interval_is_a_user_error():
    with pytest.raises(ValueError, match="rerun_every must be >= 0"):
        GuardConfig(detect=DetectConfig(rerun_every=-1))


def test_nanguard_run_rerun_every(tmp_path, capsys):
    """Zero code: `nanguard run --rerun-every 1` on a script that flips one in-range bit of an
    activation at step 15 (its own FaultInjector): the alarm and the cause name that step;
    a negative interval is a one-line usage error."""
    import json
    from pathlib import Path

    from in_process import nanguard

    root = Path(__file__).resolve().parents[1]
    script = root / "tests" / "programs" / "scripts" / "flipped_mlp.py"
    out = tmp_path / "run"
    # The command's `main` in this process: its exit code, stderr and record are what is read.
    r = nanguard(["run", "--rerun-every", "1", "--out", str(out), str(script), "--flip-at", "15"],
                 tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step 15 rerun_mismatch" in r.stderr
    report = json.loads((out / "report.json").read_text())
    assert [(a["step"], a["kind"]) for a in report["alarms"]] == [(15, "rerun_mismatch")]
    assert report["diagnosis"][0]["cause"] == "nondeterministic"
    # The usage error, in this process (no interpreter start for a one-line refusal).
    from nanguard.cli.main import main

    capsys.readouterr()
    assert main(["run", "--rerun-every", "-1", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "--rerun-every must be >= 0" in err, err
