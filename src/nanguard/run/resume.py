"""Resume points: re-run a failing step from a fork of the run taken shortly before it.

When `nanguard run` cannot replay a failing step in process (raw tensors trained without an
`nn.Module`, a NaN made by the script's own arithmetic after the model: pinpoint/recorded.py
says why), it re-runs the script with the op checker armed at that step. From the script's
start, a failure hours into a run costs hours. Resume points start that re-run shortly before
the failure instead:

* every `every` seconds, at a `backward()` outside an optimizer step, the run forks
  (`os.fork`). Points are spaced further apart when they cost more than 1% of the run: a fork
  is paid for by the run itself, whose first write to each page it now shares with a child
  copies that page (measured after each fork over the next iterations; a model of 400 MB
  with Adam costs seconds per fork, so its points come minutes apart). The child is a
  copy-on-write snapshot of the whole process: model, optimizer, RNG states, the data
  iterator, the script's own locals. It waits on a pipe with its output sent to /dev/null.
  The two newest are kept (a failure found at the step after a point was taken still has the
  one before);
* at a failure, the newest point taken before the failing step gets a "go". The child lets go
  of every hook of the run (nothing of the parent's store, writer thread or run folder is
  touched), arms `pinpoint.armed` at the failing step, runs the script on from where it stood,
  writes the origin to a file and leaves at once (`os._exit`: none of the script's cleanup);
* at the end of the run every other point is told to quit.

No point is taken, and the re-run starts from the beginning, when:
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

import contextlib
import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["ResumePoints"]

_KEEP = 2
_SHARE = 0.01
"""The most of a run's time that taking points may cost."""
_AFTER = 3
"""Iterations after a fork that calibrate what one copy-on-write fault costs."""
_FAULT_S = 5e-6
"""What one such fault costs until calibrated (seconds; 2-7 us measured on a 2-core VM)."""


@dataclass(kw_only=True)
class _Point:
    pid: int
    pipe: int
    """The write end of the pipe the child waits on (this process's side)."""
    steps: int
    """Optimizer steps started when it was taken, all optimizers together (what `armed`
    counts); the step in progress then is never the one armed."""
    manual: bool
    """Hand-written updates (`ManualStep` boundaries): the step in progress is not counted
    by the child's own boundaries."""


@dataclass(kw_only=True)
class _Child:
    """This process is a point's child that got its "go"."""

    result: Path
    step: int
    """The step armed, counted from entering `armed` in the child."""
    from_step: int
    state: Any = None
    context: Any = None


CHILD: _Child | None = None
"""Set in a point's child once it goes on with the script (`run_script` then ends it
with `child_done` wherever the script stops)."""


class ResumePoints:
    """Take resume points while a run is healthy and run a failing step from the last one.

    Args:
        every: seconds between points (<= 0: none are taken).
        failed: whether the run has seen a non-finite value (no point is taken after it).
        go: called in the child with its "go" message, before the script runs on: lets go of
            the parent's hooks and arms the checker (`rerun.go_on`).
    """

    def __init__(self, every: float, *, failed: Callable[[], bool],
                 go: Callable[[_Point, dict[str, Any]], None]) -> None:
        self.every = every
        self.failed = failed
        self.go = go
        self.points: list[_Point] = []
        self.taken = 0
        self.refused: str | None = None
        """Why the last point that was due was not taken."""
        self._last = time.monotonic()
        self.bill = _Bill()

    @property
    def interval(self) -> float:
        """Seconds between points now: `every`, or more while the last one has cost more
        than `_SHARE` of the time since (see `_Bill`)."""
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
        self.refused = _unsafe()
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
            self._wait_in_child(r, _Point(pid=0, pipe=-1, steps=steps, manual=manual))
            return
        os.close(r)
        self.points.append(_Point(pid=pid, pipe=w, steps=steps, manual=manual))
        self.taken += 1
        while len(self.points) > _KEEP:
            _quit(self.points.pop(0))

    def _wait_in_child(self, r: int, point: _Point) -> None:
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
            message = _read_line(r)
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
            code = _wait(point.pid, budget)
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


class _Bill:
    """What the last point has cost the run so far, in seconds.

    A fork is paid for by the run itself: its first write to each page it now shares with a
    child copies that page (a minor page fault), in the iterations right after the fork and,
    for pages written rarely, long after. The bill is the fork itself plus the extra minor
    faults since (above the run's usual rate per iteration, measured while no fork was
    being paid for) times the time one costs, calibrated in the `_AFTER` iterations after
    each fork from their extra time over their extra faults.
    """

    def __init__(self) -> None:
        self.cost = 0.0
        self.calibrating = 0
        """Iterations after the last fork still calibrating the time of one fault."""
        self.usual = 0
        """Iterations that measured the run's own time and faults (no point before 3)."""
        self._fork_s = 0.0
        self._extra_faults = 0.0
        self._per_fault = _FAULT_S
        self._cal_s = self._cal_faults = 0.0
        self._period: float | None = None
        self._rate: float | None = None
        self._at: tuple[float, int] | None = None

    def forked(self, seconds: float) -> None:
        """A point was taken; the fork itself took `seconds`."""
        self._fork_s, self._extra_faults = seconds, 0.0
        self._cal_s = self._cal_faults = 0.0
        self.calibrating = _AFTER
        self.cost = seconds
        self._at = (time.monotonic(), _minor_faults())

    def iteration(self, now: float) -> None:
        """At each iteration (a backward outside an optimizer step)."""
        faults = _minor_faults()
        if self._at is not None:
            dt, df = now - self._at[0], faults - self._at[1]
            period = self._period if self._period is not None else dt
            rate = self._rate if self._rate is not None else float(df)
            extra = max(0.0, df - rate)
            if self.calibrating:
                self._cal_s += max(0.0, dt - period)
                self._cal_faults += extra
                self.calibrating -= 1
                if not self.calibrating and self._cal_faults >= 100:
                    self._per_fault = min(max(self._cal_s / self._cal_faults, 1e-7), 1e-4)
            elif not (self._fork_s and df > 1.5 * rate + 16):
                # A usual iteration (not one still copying pages): the run's own rates, down
                # at once, up slowly (the first iterations allocate the optimizer's state).
                self._period = _low(self._period, dt)
                self._rate = _low(self._rate, float(df))
                self.usual += 1
            self._extra_faults += extra
            if self._fork_s:
                self.cost = self._fork_s + self._extra_faults * self._per_fault
        self._at = (now, faults)


def _low(mean: float | None, value: float) -> float:
    return value if mean is None or value < mean else 0.9 * mean + 0.1 * value


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ---------------------------------------------------------------------- in the child


def child_done(script_error: str | None = None) -> None:
    """End a point's child: its result written, the process gone (no cleanup of the
    script's runs, no atexit). Does nothing outside a child."""
    child = CHILD
    if child is None:
        return
    try:
        # Fills the origin of a step cut short; what was found is written all the same.
        with contextlib.suppress(Exception):
            child.context.__exit__(None, None, None)
        state = child.state
        origin = state.origin.to_dict() if state.origin is not None else None
        out = {"origin": origin, "ran": state.ran, "from_step": child.from_step}
        if script_error:
            out["script_error"] = script_error
        child.result.write_text(json.dumps(out))
    finally:
        os._exit(0)


def arm_child(point: _Point, go: dict[str, Any]) -> None:
    """In a point's child, after the run's hooks are gone: arm the checker at the failing
    step and end the child right after it."""
    global CHILD
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from nanguard.pinpoint.armed import armed
    from nanguard.run import manual

    manual.own_hooks()
    # Counted from here: a real optimizer's step in progress is counted by the child's hook;
    # a hand-written one's began in the run's own boundaries, which are gone.
    step = int(go["step"]) - point.steps - (1 if point.manual else 0)
    assert step >= 0, (go, point)
    context = armed(step, expect_loss=go.get("expect_loss"))
    child = _Child(result=Path(go["result"]), step=step, from_step=point.steps,
                   context=context)
    child.state = context.__enter__()
    CHILD = child

    def stop(*_: Any) -> None:
        if child.state.steps_seen > child.step:
            child_done()

    register_optimizer_step_post_hook(stop)


# ---------------------------------------------------------------------- helpers


def _unsafe() -> str | None:
    """Why this process cannot be forked safely now (None: it can)."""
    import multiprocessing

    if not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"):
        return "no fork() here"
    if torch.cuda.is_initialized():
        return "CUDA is in use (a CUDA context does not survive a fork)"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "torch.distributed is in use"
    if multiprocessing.active_children():
        return "the run holds worker processes (DataLoader workers)"
    try:
        if any(_link(fd).startswith("socket:") for fd in os.listdir("/proc/self/fd")):
            return "the run holds a socket (an experiment tracker's connection?)"
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        available = _mem_available()
    except OSError as exc:
        return f"cannot inspect the process ({exc})"
    if available is not None and rss * _KEEP > available:
        return f"not enough free memory for {_KEEP} copies of {rss >> 20} MiB"
    return None


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since the listing (the listing's own fd)
        return ""


def _mem_available() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def _read_line(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:  # the run is gone
            break
        data += chunk
    return data.decode().strip()


def _wait(pid: int, budget: float) -> int | None:
    """The child's exit code, or None (it was killed) when it ran past `budget` seconds."""
    deadline = time.monotonic() + budget
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            _kill(pid)
            return None
        time.sleep(0.02)


def _quit(point: _Point) -> None:
    try:
        os.write(point.pipe, b"quit\n")
        os.close(point.pipe)
    except OSError:
        pass
    if _wait(point.pid, 5.0) is None:
        return  # killed


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
