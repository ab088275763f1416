"""Crash safety (DESIGN.md section 5): a recording run SIGKILLed at a random step leaves a store
that opens and holds every completed step, and `load_report` rebuilds a report from it.

The training script runs in a subprocess, prints each step number right after its
`optimizer.step()` returns (the guard has recorded the step by then) and flushes; the parent kills
it with SIGKILL after reading step N, for N drawn at random (seeded per test run).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import nanguard
from nanguard.record.store import open_run

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from nanguard import Guard, GuardConfig, RecordConfig
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard = Guard(model, opt, activations=True,
                  config=GuardConfig(record=RecordConfig(out=sys.argv[1], summary=False)))
    step = 0
    while True:  # until killed
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        if step == 7:
            x[0, 0] = float("nan")  # a non-finite step the rebuilt report must show
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        if step == 7:
            for p in model.parameters():
                p.grad = torch.nan_to_num(p.grad, nan=0.0)
        opt.step()
        print(step, flush=True)
        step += 1
    """
)


@pytest.mark.parametrize("attempt", range(3))
def test_sigkill_keeps_every_completed_step(tmp_path, attempt):
    rnd = random.Random(f"{os.getpid()}-{attempt}")
    kill_after = rnd.randint(8, 120)
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "run"
    env = dict(os.environ)
    src = str(Path(nanguard.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(script), str(folder)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    last = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            last = int(line)
            if last >= kill_after:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert last == kill_after, f"script died at step {last}: {err[-2000:]}"
    assert not (folder / "report.json").exists()  # it never closed

    db = open_run(folder)
    try:
        steps = [s for (s,) in db.execute("SELECT step FROM steps ORDER BY step")]
    finally:
        db.close()
    # Every step whose optimizer.step() returned is there, contiguous from 0.
    assert len(steps) >= kill_after + 1
    assert steps == list(range(len(steps)))

    report = nanguard.load_report(folder)
    assert report.steps == len(steps)
    assert report.status == "failed"
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == 7
    assert any(a["kind"] == "nonfinite" and a["step"] == 7 for a in report.alarms)
    assert report.run.get("closed") is False
