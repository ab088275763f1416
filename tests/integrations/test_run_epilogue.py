"""`nanguard run` fails open in its own epilogue too: an error of nanguard's after the script
has ended (settling, closing, re-running, writing) never reaches the user as a traceback; the
run still ends with a report.json holding what was recorded, and the exit code follows the
usual rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from _run import report

from nanguard.run import runner
from nanguard.run.runner import RunOptions, run

SCRIPT = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(5):
    x = torch.randn(8, 4)
    if step == 2 and "--poison" in sys.argv:
        x[5, 1] = float("nan")
    opt.zero_grad()
    loss = (model(x) - 1).pow(2).mean()
    loss.backward()
    opt.step()
print("done")
"""


def _broken(*_: object, **__: object) -> None:
    raise RuntimeError("a bug in the epilogue")


@pytest.mark.parametrize("policy", ["observe", "raise"])
def test_an_error_after_the_script_keeps_the_failed_finding(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        policy: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    # The re-run that pinpoints the origin is the epilogue's biggest part: it breaks.
    monkeypatch.setattr(runner, "rerun_step", _broken)
    rc = run(RunOptions(script=str(script), args=["--poison"], out=str(out), policy=policy,
                        summary=False))
    assert rc == 1
    rep = report(out)
    assert rep["status"] == "failed"
    assert rep["first_nonfinite"]["step"] == 2
    assert rep["diagnosis"], rep  # the guard's own diagnosis, from the watched signals
    assert rep["run"]["internal_error"]["error"] == "RuntimeError: a bug in the epilogue"
    assert (out / "nanguard_error.txt").is_file()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error after the script ended" in err


def test_an_error_after_a_healthy_script_is_degraded_not_healthy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "write_folder", _broken)
    rc = run(RunOptions(script=str(script), out=str(out), summary=False))
    rep = report(out)
    # The guard watched every step, but its record was not laid out: not `healthy`.
    assert (rc, rep["status"], rep["steps"]) == (1, "degraded", 5)
    assert rep["run"]["script"]["outcome"] == "ok"
