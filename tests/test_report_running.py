"""`nanguard report` on a run that is still training says `running`, not `died`.

A real training process (the cascade scenario under a Guard) pauses at points it is told to;
while it is alive its run folder reads `running` (exit 0 while nothing non-finite was seen,
1 once it was), and once it is killed with SIGKILL the same folder reads `died`. The same holds
for `nanguard run`, whose record lies in a part folder until the script ends.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT
from nanguard.cli.main import main
from nanguard.record.process import alive, identity
from nanguard.record.report import Report, load_report

SCRIPT = """\
import sys, time
from pathlib import Path
from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.scenarios.cascade import make_cascade

here = Path(sys.argv[1])
guarded = sys.argv[2] == "guard"
s = make_cascade(0, steps=40, outlier_at=10)
guard = None
if guarded:
    cfg = GuardConfig(record=RecordConfig(out=str(here / "run"), summary=False))
    guard = Guard(s.model, s.optimizer, config=cfg)
for step, (x, y) in enumerate(s.batches):
    for pause in (5, 20):  # wait at these steps until told to go on
        while step == pause and not (here / f"go-{pause}").exists():
            (here / f"at-{pause}").touch()
            time.sleep(0.05)
    loss = s.loss_fn(s.model(x), y)
    s.optimizer.zero_grad()
    loss.backward()
    s.optimizer.step()
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    return env


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the training process ended early"
        assert time.monotonic() < end, f"timed out waiting for {path}"
        time.sleep(0.05)


def _settled(folder: Path, steps: int, timeout: float = 30) -> Report:
    """The report once the writer thread has committed `steps` steps (it commits every
    `flush_seconds`; a step with a non-finite value at once)."""
    end = time.monotonic() + timeout
    while (report := load_report(folder)).steps < steps:
        assert time.monotonic() < end, f"only {report.steps} steps committed"
        time.sleep(0.1)
    return report


def _report(folder: Path) -> tuple[int, str]:
    """`nanguard report FOLDER` in this process (the training runs in another): its exit code
    and what it printed."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["report", str(folder)])
    return code, out.getvalue() + err.getvalue()


def _check(tmp_path: Path, cmd: list[str], folder: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_for(tmp_path / "at-5", proc)
        report = _settled(folder, 5)
        assert report.status == "running" and report.first_nonfinite is None
        assert report.steps == 5
        rc, out = _report(folder)
        assert rc == 0 and "running: 5 steps recorded" in out
        (tmp_path / "go-5").touch()  # on into the cascade (non-finite from step 15)
        _wait_for(tmp_path / "at-20", proc)
        report = _settled(folder, 20)
        assert report.status == "running" and report.first_nonfinite is not None
        assert report.first_nonfinite["step"] == 15 and report.alarms
        rc, out = _report(folder)
        assert rc == 1 and "non-finite values seen" in out
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        report = load_report(folder)
        assert report.status in ("died", "failed")  # a non-finite value decides first
        assert report.run.get("closed") is False
        rc, _ = _report(folder)
        assert rc == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_guard_run_reads_running_then_died(tmp_path: Path) -> None:
    _check(tmp_path, [sys.executable, "train.py", str(tmp_path), "guard"], tmp_path / "run")


def test_nanguard_run_reads_running_while_the_script_trains(tmp_path: Path) -> None:
    _check(tmp_path, [sys.executable, "-m", "nanguard", "run", "--out", "run",
                      "--fork-every", "0", "train.py", str(tmp_path), "plain"], tmp_path / "run")


def test_a_reused_or_foreign_pid_is_not_alive() -> None:
    me = identity()
    assert alive(me) is True
    # Another start tick: the pid was reused (where /proc tells start ticks).
    assert alive({**me, "start_tick": (me["start_tick"] or 0) + 1}) is (
        me["start_tick"] is None)
    assert alive({**me, "host": me["host"] + "-elsewhere"}) is None
    assert alive(None) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert alive({**me, "pid": dead.pid, "start_tick": None}) is False
