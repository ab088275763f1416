"""Resume points: re-run a failing step from a fork of the run taken shortly before it.

When `nanguard run` cannot replay a failing step in process (raw tensors trained without an
`nn.Module`, a NaN made by the script's own arithmetic after the model: pinpoint/recorded.py
says why), it re-runs the script with the op checker armed at that step. From the script's
start, a failure hours into a run costs hours. Resume points start that re-run shortly before
the failure instead:

* every `every` seconds, at a `backward()` outside an optimizer step, the run forks
  (`os.fork`). Points are spaced further apart when they cost more than 1% of the run: a fork
  is paid for by the run itself, whose first write to each page it now shares with a child
  copies that page (measured after each fork over the next iterations, run/fork_cost.py:
  a large model with Adam can pay seconds per fork, so its points come minutes apart;
  BENCHMARKS.md, "Resume points"). The child is a
  copy-on-write snapshot of the whole process: model, optimizer, RNG states, the data
  iterator, the script's own locals. It waits on a pipe with its output sent to /dev/null.
  The two newest are kept (a failure found at the step after a point was taken still has the
  one before);
* at a failure, the newest point taken before the failing step gets a "go". The child lets go
  of every hook of the run (nothing of the parent's store, writer thread or run folder is
  touched), arms `pinpoint.armed` at the failing step, runs the script on from where it stood,
  writes the origin to a file and leaves at once (`os._exit`: none of the script's cleanup;
  run/resume_child.py);
* at the end of the run every other point is told to quit.

No point is taken, and the re-run starts from the beginning, when (run/forks.py):
* the process uses CUDA: a CUDA context does not survive a fork;
* it holds worker processes (DataLoader workers: the child would read the parent's batches);
* it holds sockets (an experiment tracker's connection the child would write into);
* it runs under torch.distributed;
* the machine lacks the memory for the copies. A child shares the parent's pages until either
  writes them, so at worst each holds a full copy of what the run changes.

Inside `optimizer.step(closure)` (LBFGS) no point is taken either: every backward of such a
script runs there.

The child runs one intra-op thread, because OpenMP's thread pool does not survive a fork. Sums
can then differ from the run's in their last bits, and with several threads `reproduced`
means "the step failed again", not "bit for bit the same loss". A child that runs clean at the
failing step sends the caller back to the re-run from the start. The steps a child replays
run the script's own code again: a file it writes in them is written again, with the same
contents.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanguard.run.fork_cost import ForkCost
from nanguard.run.forks import fork_refusal, read_line, wait_exit

__all__ = ["Point", "ResumePoints"]

_KEEP = 2
"""Points kept: the newest two (a failure found at the step after a point still has the one
before)."""
_SHARE = 0.01
"""The most of a run's time that taking points may cost."""


@dataclass(kw_only=True)
class Point:
    """A resume point: a forked child waiting on a pipe for its "go" or its "quit"."""

    pid: int
    pipe: int
    """The write end of the pipe the child waits on (this process's side)."""
    steps: int
    """Optimizer steps started when it was taken, all optimizers together (what `armed`
    counts); the step in progress then is never the one armed."""
    manual: bool
    """Hand-written updates (`ManualStep` boundaries): the step in progress is not counted
    by the child's own boundaries."""


class ResumePoints:
    """Take resume points while a run is healthy and run a failing step from the last one.

    Args:
        every: seconds between points (<= 0: none are taken).
        failed: whether the run has seen a non-finite value (no point is taken after it).
        go: called in the child with its "go" message, before the script runs on: lets go of
            the parent's hooks and arms the checker (`rerun.go_on`).
    """

    def __init__(self, every: float, *, failed: Callable[[], bool],
                 go: Callable[[Point, dict[str, Any]], None]) -> None:
        self.every = every
        self.failed = failed
        self.go = go
        self.points: list[Point] = []
        self.taken = 0
        self.refused: str | None = None
        """Why the last point that was due was not taken."""
        self._last = time.monotonic()
        self.bill = ForkCost()

    @property
    def interval(self) -> float:
        """Seconds between points now: `every`, or more while the last one has cost more
        than `_SHARE` of the time since (see `ForkCost`, run/fork_cost.py)."""
        return max(self.every, self.bill.cost / _SHARE)

    def at_backward(self, steps: int, *, manual: bool) -> None:
        """Called at a `backward()` outside an optimizer step, before it runs. Takes a point
        when one is due (a clock read and a `getrusage` otherwise). In a child, returns after
        its "go"."""
        if self.every <= 0 or steps < 1:
            return
        now = time.monotonic()
        self.bill.iteration(now)
        if (self.bill.calibrating or self.bill.usual < 3
                or now - self._last < self.interval):
            return
        self._last = now
        if self.failed():
            return
        self.refused = fork_refusal(_KEEP)
        if self.refused is None:
            try:
                self._take(steps, manual)
            except OSError as exc:  # no fork now (out of memory, of processes): none again
                self.refused, self.every = f"fork() failed ({exc})", 0.0
                return
            self.bill.forked(time.monotonic() - now)

    def _take(self, steps: int, manual: bool) -> None:
        for stream in (sys.stdout, sys.stderr):  # or the child holds a copy of what is unsent
            stream.flush()
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:
            os.close(w)
            self._wait_in_child(r, Point(pid=0, pipe=-1, steps=steps, manual=manual))
            return
        os.close(r)
        self.points.append(Point(pid=pid, pipe=w, steps=steps, manual=manual))
        self.taken += 1
        while len(self.points) > _KEEP:
            _quit(self.points.pop(0))

    def _wait_in_child(self, r: int, point: Point) -> None:
        try:
            for other in self.points:
                os.close(other.pipe)
            self.points = []
            os.setsid()  # out of the terminal's process group: ^C is the run's, not ours
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            message = read_line(r)
            if not message or message == "quit":
                os._exit(0)
            torch.set_num_threads(1)  # OpenMP's pool is the parent's: one thread here
            self.go(point, json.loads(message))
        except BaseException:  # noqa: BLE001 - a child never returns into the script broken
            os._exit(3)

    def replay(self, global_step: int, *, expect_loss: float | None,
               budget: float) -> dict[str, Any] | None:
        """Run step `global_step` (counted over all optimizers) under the checker in the
        newest point taken before it. Returns None when no point fits; else a dict with
        `status` (`found`, `not_reproduced`, `budget_exhausted`, `error`), `from_step`,
        `seconds` and, when found, `origin`."""
        # The step in progress when a point was taken is not armed; a hand-written one is
        # armed from the update before it (pinpoint/armed.py), so one more step is needed.
        fits = [p for p in self.points if p.steps + (2 if p.manual else 1) <= global_step]
        if not fits:
            return None
        point = fits[-1]
        for p in self.points:
            if p is not point:
                _quit(p)
        self.points = []
        if torch.get_num_threads() != 1:
            expect_loss = None  # the child's sums may differ in their last bits
        info: dict[str, Any] = {"from_step": point.steps, "points_taken": self.taken,
                                "interval_s": round(self.interval, 2),
                                "point_cost_s": round(self.bill.cost, 4)}
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="nanguard-resume-") as tmp:
            result = Path(tmp) / "result.json"
            go = {"step": global_step, "expect_loss": expect_loss, "result": str(result)}
            try:
                os.write(point.pipe, (json.dumps(go) + "\n").encode())
            except OSError as exc:
                info.update(status="error", reason=f"the resume point is gone ({exc})")
                return info
            os.close(point.pipe)
            code = wait_exit(point.pid, budget)
            info["seconds"] = round(time.monotonic() - started, 2)
            if code is None:
                info.update(status="budget_exhausted")
                return info
            if not result.is_file():
                info.update(status="error", reason=f"the resume point exited with code {code}")
                return info
            found = json.loads(result.read_text())
        origin = found.get("origin")
        if origin and origin.get("phase"):
            info.update(status="found", origin=origin)
        else:
            info.update(status="not_reproduced",
                        reason="clean at that step from the resume point" if found.get("ran")
                        else "the resume point never reached that step")
        return info

    def summary(self) -> dict[str, Any]:
        """For report.json (`run.resume_points`): how many were taken, how far apart, what the
        last one cost, and why the last one due was not taken."""
        out: dict[str, Any] = {"taken": self.taken, "interval_s": round(self.interval, 2),
                               "point_cost_s": round(self.bill.cost, 4)}
        if self.refused:
            out["not_taken"] = self.refused
        return out

    def close(self) -> None:
        """Tell every point left to quit, and reap it."""
        for p in self.points:
            _quit(p)
        self.points = []


def _quit(point: Point) -> None:
    """Tell a point's child to quit, and reap it (killed when it does not within 5 s)."""
    try:
        os.write(point.pipe, b"quit\n")
        os.close(point.pipe)
    except OSError:
        pass
    wait_exit(point.pid, 5.0)
