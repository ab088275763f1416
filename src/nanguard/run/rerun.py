"""The pinpointing re-run of `nanguard run`: the failing step run again under the op checker.

`rerun_step` runs after the script, when a guard's finding has no origin from its in-process
replay (run/runner.py decides when): from the newest resume point before the failing
step (run/resume.py) and, when there is none or it ran clean there, the whole script
from its start in a subprocess (`python -m nanguard.run.replay`: the same initial RNG
states, `pinpoint.armed` at the step counted over all optimizers), in its own session, killed
when `--replay-budget` runs out. It returns what the re-run found (`origin`) or why it found
nothing. `seen_nonfinite` and `go_on` are the callbacks the resume points are built with while
the script runs: whether the run has failed already (no more forks), and what a resume
point's child does before it goes on with the script.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nanguard.run import resume_child
from nanguard.run.discovery import Discovery
from nanguard.run.replay import record_nothing
from nanguard.run.resume import ResumePoints
from nanguard.run.watched import Watched
from nanguard.watch import rng

__all__ = ["go_on", "release_findings", "rerun_step", "seen_nonfinite"]


def seen_nonfinite(disc: Discovery) -> bool:
    """Whether any guard has seen a non-finite value (no resume point is taken after it)."""
    return any(w.guard is not None and w.guard.first_nonfinite is not None
               for w in disc.watched)


def release_findings(disc: Discovery) -> None:
    """The re-run is over, or none was needed: each guard's finding, held while it could
    still change (`Events.hold`), leaves now with the record's cause."""
    for w in disc.watched:
        if w.guard is not None:
            w.guard.events.release()


def go_on(disc: Discovery, point: Any, message: dict[str, Any]) -> None:
    """In a resume point's child: let go of the run's hooks (its guards record nothing
    here, nor does any guard the script builds) and arm the checker at the failing step."""
    disc.stand_aside()
    record_nothing()
    resume_child.arm_child(point, message)


def rerun_step(
    script: Path, args: list[str], w: Watched, initial_rng: dict[str, Any], budget: float,
    *, global_step: int | None = None, points: ResumePoints | None = None,
) -> dict[str, Any]:
    """Run the failing step again with the checker armed: from the newest resume point
    before it when there is one, else the whole script in a subprocess (`global_step`
    overrides the step counted over all optimizers: a value found after the last step is in
    the step that never completed)."""
    guard = w.guard
    assert guard is not None and guard.first_nonfinite is not None
    step = int(guard.first_nonfinite["step"])
    if global_step is None:
        global_step = w.global_step(step)
    info: dict[str, Any] = {"status": "error", "step": step, "budget_s": budget}
    if global_step is None:
        info["reason"] = "the failing step was not seen starting"
        return info
    info["global_step"] = global_step
    expected = _failing_loss(guard, step)
    if points is not None:
        resumed = points.replay(global_step, expect_loss=expected, budget=budget)
        if resumed is not None:
            if resumed["status"] == "found":
                resumed["origin"]["step"] = step
            if resumed["status"] in ("found", "budget_exhausted"):
                info.update(resumed, mode="resume_point")
                if resumed["status"] == "budget_exhausted":
                    info["reason"] = (f"the re-run from the resume point at step "
                                      f"{resumed['from_step']} did not finish within "
                                      f"--replay-budget {budget:g} s")
                return info
            # Clean there (its sums in another order?) or gone: from the start, in the time
            # that is left.
            info["resume_point"] = {k: resumed.get(k) for k in ("from_step", "status",
                                                                 "reason", "seconds")}
            budget = max(1.0, budget - float(resumed.get("seconds") or 0.0))
        elif points.refused:
            info["resume_point"] = {"status": "not_taken", "reason": points.refused}
    info["mode"] = "from_start"
    with tempfile.TemporaryDirectory(prefix="nanguard-replay-") as tmp:
        rng_file, result_file, log_file = (Path(tmp) / n for n in ("rng.pt", "result.json",
                                                                      "stderr.txt"))
        rng_file.write_bytes(rng.dumps(initial_rng))
        cmd = [sys.executable, "-m", "nanguard.run.replay", "--step", str(global_step),
               "--rng", str(rng_file), "--result", str(result_file), "--", str(script), *args]
        env = dict(os.environ)
        if expected is not None:  # `reproduced`: the re-run's loss at that step, bit for bit
            env["NANGUARD_EXPECT_LOSS"] = repr(expected)
        src_root = str(Path(__file__).resolve().parents[2])  # importable as we are
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        started = time.monotonic()
        with open(log_file, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=log, env=env, start_new_session=True)
            try:
                proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                _kill(proc)
                info.update(status="budget_exhausted", seconds=round(time.monotonic() - started,
                                                                       2),
                            reason=f"the re-run did not finish within --replay-budget {budget:g} s;"
                            " the finding is from the watched signals only")
                return info
        info["seconds"] = round(time.monotonic() - started, 2)
        if not result_file.is_file():
            tail = log_file.read_text(errors="replace")[-400:].strip()
            info["reason"] = f"the re-run exited with code {proc.returncode}: {tail}"
            return info
        result = json.loads(result_file.read_text())
    origin = result.get("origin")
    if origin and origin.get("phase"):
        origin["step"] = step
        info.update(status="found", origin=origin)
    else:
        info.update(status="not_reproduced",
                    reason="the re-run was clean at that step (non-deterministic script?)"
                    if result.get("ran") else "the re-run never reached that step")
    return info


def _failing_loss(guard: Any, step: int) -> float | None:
    stats = getattr(guard, "failing_stats", None)
    if stats is None or stats.step != step or stats.loss is None:
        return None
    return float(stats.loss)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the re-run and everything it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
