"""A failure late in a run that cannot be replayed in process is re-run from a resume point (a
fork of the run taken shortly before it), not from the script's start.

Raw tensors trained without an `nn.Module` and losses written as the script's own arithmetic
are the cases the in-process replay refuses. The scripts run black box through `nanguard run`
with resume points every fraction of a second. The expected step and phase come from the same
script under the independent tracer (`scripts/_nantrace.py`); the op and line from the script's
text; the cause from what the script itself prints under the tracer (the first step where the
sigmoid rounded to exactly 0 or 1).

Each `nanguard run` here is a process of its own (`process=True`): resume points are forks of
the process that runs the script, and the tests look for the ones left behind by their command
line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from programs_support import SCRIPTS, both, guarded, plain, script_line

RAW = "raw_logreg.py"


def _processes_naming(text: str) -> list[int]:
    """Pids of live processes whose command line holds `text` (a resume point left behind
    has the run's own command line)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(pid))
    return pids


@pytest.mark.parametrize("update", ["sgd", "manual"])
def test_raw_tensor_script_failing_late_is_rerun_from_a_resume_point(
        tmp_path: Path, update: str) -> None:
    """The textbook script trains `W` and `b` for 2000 steps (by `optim.SGD`, or by hand under
    `no_grad`); at step 1531 a sigmoid rounds to exactly 0 and its log is -inf. The in-process
    replay refuses (no module), and the re-run starts from a resume point a few hundred steps
    before, not from the start: the log at the cost line, phase `loss`, cause
    `saturated_loss`."""
    args = ("--epochs", "250", "--lr", "0.1", "--update", update)
    traced, g = both(tmp_path, RAW, *args, options=("--fork-every", "0.3"), process=True)
    assert traced.first is not None and traced.first["phase"] == "loss", traced
    step = traced.first["step"]
    assert f"NANTRACE_SATURATED {step}\n" in traced.stderr  # the sigmoid hit 0/1 right there
    replay = g.report["run"]["replay"]
    first = g.first
    got = {"status": g.report["status"], "exit": g.proc.returncode, "replay": replay["status"],
           "mode": replay.get("mode"),
           **{k: first.get(k) for k in ("step", "phase", "op", "source", "reproduced")},
           "cause": g.causes[0] if g.causes else None}
    want = {"status": "failed", "exit": 1, "replay": "found", "mode": "resume_point",
            "step": step, "phase": "loss", "op": "aten.log",
            "source": f"{SCRIPTS / RAW}:{script_line(RAW, 'cost = -(y * torch.log(h)')}",
            "reproduced": True, "cause": "saturated_loss"}
    assert got == want, g.explain()
    assert 0 < replay["from_step"] < step, replay
    assert "raw tensors" in replay["in_process"], replay
    assert _processes_naming(str(g.out)) == []  # every resume point is gone


def test_script_loss_arithmetic_late_in_a_run_is_rerun_from_a_resume_point(
        tmp_path: Path) -> None:
    """The hand-written masked mean (`(per_token * mask).sum() / mask.sum()`) goes 0 / 0 at
    batch 900 of 1000: the re-run starts from a resume point taken after step 0 and names the
    division of the loss line."""
    name = "masked_tokens.py"
    traced, g = both(tmp_path, name, "--steps", "1000", "--empty-step", "900",
                     options=("--fork-every", "0.3"), process=True)
    assert traced.first == {"step": 900, "phase": "loss"}, traced
    replay = g.report["run"]["replay"]
    first = g.first
    got = {"replay": replay["status"], "mode": replay.get("mode"),
           **{k: first.get(k) for k in ("step", "phase", "op", "source")},
           "cause": g.causes[0] if g.causes else None}
    line = script_line(name, "loss = (per_token * mask).sum() / mask.sum()")
    want = {"replay": "found", "mode": "resume_point", "step": 900, "phase": "loss",
            "op": "aten.div", "source": f"{SCRIPTS / name}:{line}",
            "cause": "division_by_zero"}
    assert got == want, g.explain()
    assert 0 < replay["from_step"] < 900 and replay["points_taken"] >= 1, replay
    assert replay["interval_s"] >= 0.3, replay


def test_resume_points_leave_a_healthy_run_untouched(tmp_path: Path) -> None:
    """Points asked for every 0.1 s through a healthy run: they are taken, spaced further
    apart than that (a fork of a process holding torch costs milliseconds, and points may
    cost at most 1% of the run); the script's output is printed once (a waiting child writes
    nothing), the parameters are bitwise those of the script run alone, the run is
    `healthy`, and no child is left when `nanguard run` is done."""
    args = ("--epochs", "100", "--lr", "0.1")
    (tmp_path / "alone").mkdir()
    alone = plain(tmp_path / "alone", RAW, *args, "--save", str(tmp_path / "alone.pt"))
    assert alone.returncode == 0, alone.stderr
    g = guarded(tmp_path, RAW, *args, "--save", str(tmp_path / "guarded.pt"),
                options=("--fork-every", "0.1"), process=True)
    assert (g.report["status"], g.proc.returncode) == ("healthy", 0), g.explain()
    points = g.report["run"]["resume_points"]
    assert points["taken"] >= 1 and points["interval_s"] > 0.1, points
    assert points["interval_s"] >= round(100 * points["point_cost_s"], 2) - 0.01, points
    assert g.proc.stdout == alone.stdout
    a, w = torch.load(tmp_path / "alone.pt"), torch.load(tmp_path / "guarded.pt")
    assert all(torch.equal(a[k], w[k]) for k in ("W", "b"))
    assert _processes_naming(str(g.out)) == []


def test_no_resume_point_while_dataloader_workers_run(tmp_path: Path) -> None:
    """A fork would share the DataLoader workers' queues with the run: no point is taken, the
    re-run goes back to the start and the report says why."""
    # Image 319 is the last of the epoch's order (step 7): points are due long before.
    g = guarded(tmp_path, "cnn_workers.py", "--nan-index", "319",
                options=("--fork-every", "0.01"), process=True)
    replay = g.report["run"]["replay"]
    assert replay.get("mode") == "from_start", g.explain()
    assert replay.get("resume_point", {}).get("status") == "not_taken", replay
    assert "worker processes" in replay["resume_point"]["reason"], replay
