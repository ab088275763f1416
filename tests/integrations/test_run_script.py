"""`nanguard run` on unmodified scripts: the plain loop (its own guard too), argparse + LR
scheduler, a GAN with two optimizers; the script's stdout and exit code kept; a script's own
failure reported as the script's; a missing script; the re-run's budget.

The command as a user types it, in real subprocesses, where its output, exit code and error
lines are the point; the rest through `runner.run` in this process (what the command calls),
sparing an interpreter start each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _run import EXAMPLES, nanguard_here, nanguard_run, report, run

from nanguard.run.runner import RunOptions
from nanguard.run.runner import run as run_here


def test_plain_loop_nan_row_found_and_pinpointed(tmp_path: Path) -> None:
    out = tmp_path / "plain"
    r = nanguard_here(out, EXAMPLES / "plain_loop.py")  # its output and record: no boundary
    assert r.returncode == 1, r.stderr  # training failed
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 200
    assert (first["step"], first["phase"], first["samples"]) == (150, "data", [7])
    # The re-run with the checker armed found the op that first consumed it, in the script.
    assert rep["run"]["replay"]["status"] == "found"
    line = next(i for i, t in enumerate((EXAMPLES / "plain_loop.py").read_text().splitlines(), 1)
                if "loss = nn.functional.mse_loss(model(x), y)" in t)
    assert first["op"] == "aten.addmm" and first["source"].endswith(f"plain_loop.py:{line}")
    assert rep["diagnosis"][0]["cause"] == "data_nonfinite"
    assert (out / "run.db").is_file()
    assert "first non-finite at step 150" in r.stderr


def test_argparse_scheduler_healthy_keeps_stdout_and_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "healthy"
    r = nanguard_run(out, EXAMPLES / "scheduler_argparse.py", "--steps", "30", "--exit-code", "3")
    plain = run([str(EXAMPLES / "scheduler_argparse.py"), "--steps", "30"], cwd=tmp_path)
    assert r.stdout == plain.stdout  # the script's own output, untouched
    assert r.returncode == 3, r.stderr
    assert "scheduler_argparse.py exited with code 3 (the script's own exit" in r.stderr
    rep = report(out)
    # Exited non-zero with nothing non-finite seen: `crashed`, never `healthy`.
    assert rep["status"] == "crashed" and rep["steps"] == 30
    assert rep["first_nonfinite"] is None and rep["alarms"] == []
    assert rep["run"]["script"] == {"outcome": "exit", "exit_code": 3, "message": "exit code 3"}
    assert "replay" not in rep["run"]


def test_argparse_scheduler_poisoned_batch(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "poisoned"
    rc = run_here(RunOptions(script=str(EXAMPLES / "scheduler_argparse.py"),
                             args=["--steps", "30", "--poison-step", "17", "--poison-sample", "9"],
                             out=str(out), replay_budget=0, summary=False))
    assert rc == 1
    assert "done: 30 steps" in capsys.readouterr().out
    first = report(out)["first_nonfinite"]
    assert (first["step"], first["phase"], first["samples"], first["rank"]) == (17, "data", [9], 0)
    assert report(out)["run"]["replay"]["status"] == "skipped"


def test_gan_two_optimizers(tmp_path: Path) -> None:
    healthy = tmp_path / "healthy"
    gan = str(EXAMPLES / "gan_two_optimizers.py")
    assert run_here(RunOptions(script=gan, args=["--steps", "30"], out=str(healthy),
                               summary=False)) == 0
    rep = report(healthy)
    assert rep["status"] == "healthy" and rep["first_nonfinite"] is None
    assert set(rep["run"]["parts"]) == {"optimizer-0", "optimizer-1"}
    for part in ("optimizer-0", "optimizer-1"):  # one record per optimizer
        assert (healthy / part / "run.db").is_file()
        assert report(healthy / part)["steps"] == 30

    bad = tmp_path / "poisoned"
    assert run_here(RunOptions(script=gan, args=["--steps", "30", "--poison-step", "12"],
                               out=str(bad), summary=False)) == 1
    rep = report(bad)
    first = rep["first_nonfinite"]
    # The discriminator (first to step) read the bad real batch; the generator only saw its
    # NaN gradients afterwards: the merged finding is the discriminator's.
    assert (first["step"], first["phase"], first["samples"]) == (12, "data", [11])
    assert first["part"] == "optimizer-0"
    assert rep["run"]["replay"]["status"] == "found"  # armed at global step 24 = D's step 12
    assert first["source"].endswith("gan_two_optimizers.py:45")  # discriminator(real)
    assert rep["diagnosis"][0]["cause"] == "data_nonfinite"
    assert report(bad / "optimizer-1")["first_nonfinite"]["phase"] != "data"


SCRIPT_ERROR = """
import torch
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
print("trained")
raise KeyError("no such column: 'label'")
"""


def test_script_error_is_the_scripts_and_missing_script(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text(SCRIPT_ERROR)
    out = tmp_path / "run"
    r = nanguard_run(out, script)
    assert r.returncode == 1
    assert r.stdout == "trained\n"
    assert "KeyError: \"no such column: 'label'\"" in r.stderr
    assert 'broken.py", line 9' in r.stderr  # its traceback
    assert "broken.py failed with its own error, not a numerical one" in r.stderr
    assert "nanguard run: error" not in r.stderr and "a nanguard bug" not in r.stderr
    rep = report(out)
    assert rep["status"] == "crashed" and rep["steps"] == 5
    assert rep["run"]["script"]["outcome"] == "error"

    r = nanguard_run(tmp_path / "x", tmp_path / "nope.py")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"nanguard run: error: no such script: '{tmp_path / 'nope.py'}'"
    ]


SLOW_SCRIPT = """
import time
import torch
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    x = torch.randn(4, 3)
    if step == 5:
        x[2, 1] = float("nan")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.3)
"""


def test_replay_respects_its_budget(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text(SLOW_SCRIPT)
    out = tmp_path / "run"
    started = time.monotonic()
    r = nanguard_run(out, script, options=("--replay-budget", "0.5"))
    elapsed = time.monotonic() - started
    assert r.returncode == 1
    rep = report(out)
    assert rep["run"]["replay"]["status"] == "budget_exhausted"
    assert rep["run"]["replay"]["seconds"] < 3
    first = rep["first_nonfinite"]
    assert (first["step"], first["phase"], first["samples"]) == (5, "data", [2])
    assert first["op"] is None  # not pinpointed: only the watched signals
    assert "ran out of its budget (--replay-budget 0.5 s)" in r.stderr
    assert elapsed < 30
