"""LR changes between steps: a jump up without warm-up, and the LR a checkpoint carried.

An LR that goes up by `JUMP` x or more from one optimizer step to the next gives Adam's moments
(averaged over ~1/(1 - beta2) steps of the old, small updates) no time to follow: the first
updates at the new LR are many times their usual size, and a loss spike follows (issue 40: a
resumed nanoGPT whose schedule jumps 10x at a flag-chosen step peaks at 2.8-6.8x its loss).
A warm-up (an LR that grows by a few % per step) never comes near `JUMP`; a warm-up from 0 has
no LR to be a multiple of and is not a jump either.

Two rises of `JUMP` x or more are the schedule's design, not a jump (both seen as false
`lr_jump` warnings on healthy runs, and `heal` ramping over them: a healthy
`CosineAnnealingWarmRestarts` run ended 50x worse under `heal`):
- **A restart**: the LR goes back to (within `RETURN` x of) the highest LR this run has
  already stepped at: warm restarts (SGDR), cyclic schedules. The run has shown it trains at
  that LR; the spike detectors still watch what follows.
- **A warm-up from near 0** in a fresh run (no checkpoint loaded) whose LR has only gone up:
  the step before was below 1/`WARM_FROM` of the new LR, or everything trained so far adds up
  to less than 1/`JUMP` of one step at the new LR (the sum of the LR over the steps: after one
  step at the start LR, any rise of `JUMP` x). A model that has barely moved has not adapted to
  the small LR, which is what makes a jump dangerous (`LinearLR(start_factor=1e-3)`; a
  per-epoch warm-up from 1e-6). A constant LR held for a few steps and then raised 50x is a
  jump (benchmarks/spike_causes.py's `jump_held` at step 40).
A resume's first step is always judged against the LR the checkpoint carried.

`LrChanges` remembers the LR of the last step (and, after `optimizer.load_state_dict` or a
`Guard.load_state_dict`, the LR the checkpoint was saved at), so a resume whose first step
runs at 10x the LR of the run it resumes is a jump at its first step. Each jump is an `lr_jump`
alarm with its numbers (the guard records it and says it live); the `lr_jump` explain rule names
it as the cause of a spike that follows, and `heal` ramps the LR back up from the pre-jump value
(`recover.heal`). Quiet-step cost: one float comparison (the guard calls `see` only when the LR
differs from the last one).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from nanguard.detect.alarm import Alarm

JUMP = 3.0
"""An LR this many times the previous step's (or more) is a jump without warm-up."""

RETURN = 1.05
"""An LR within this factor of the highest the run has stepped at is a return to it (a restart)."""

WARM_FROM = 100.0
"""A rise from below 1/WARM_FROM of the new LR, in a fresh run whose LR only went up: a warm-up."""

FOLLOWS = 100
"""Steps after a jump in which a spike is taken to follow from it (the explain rule)."""


@dataclass(frozen=True)
class Jump:
    """One LR jump: at `step` the LR went from `old` to `new` (`new >= JUMP * old`)."""

    step: int
    old: float
    new: float
    resumed: bool = False
    """The old LR is the one a checkpoint carried (the first step after a resume)."""

    @property
    def factor(self) -> float:
        return self.new / self.old

    def text(self) -> str:
        """One line with the numbers (parsed back by `parse`: keep the two together)."""
        at = "at the resume, step" if self.resumed else "at step"
        return (f"the LR went {self.factor:.3g}x {at} {self.step} ({self.old:.3g} -> "
                f"{self.new:.3g}) without warm-up")

    def alarm(self) -> Alarm:
        """The `lr_jump` alarm (value: the factor)."""
        return Alarm(step=self.step, kind="lr_jump", signal="lr", value=self.factor,
                     message=f"{self.text()}: Adam's moments still hold the old step size, a "
                     f"loss spike may follow; warm up from {self.old:.3g} instead")


_TEXT = re.compile(r"the LR went (?P<k>[\d.e+-]+)x (?P<at>at the resume, step|at step) "
                   r"(?P<step>\d+) \((?P<old>[\d.e+-]+) -> (?P<new>[\d.e+-]+)\)")


def parse(message: str, step: int) -> Jump | None:
    """The jump an `lr_jump` alarm's message states (report.json holds the message), or None."""
    m = _TEXT.search(message)
    if m is None:
        return None
    try:
        return Jump(step, float(m["old"]), float(m["new"]), m["at"] != "at step")
    except ValueError:
        return None


class LrChanges:
    """The LR of the last step, and the jumps seen (see the module docstring)."""

    def __init__(self) -> None:
        self.last: float | None = None
        """The LR of the last step seen (or the one a checkpoint carried)."""
        self.loaded = False
        """`last` came from a checkpoint: the next step is the first after a resume."""
        self.jump: Jump | None = None
        """The latest jump."""
        self.jumps = 0
        """Jumps seen over the run."""
        self.peak = 0.0
        """The highest LR the run has stepped at (or a checkpoint carried)."""
        self.resumed = False
        """A checkpoint's LR was loaded: the run trained before this process (no warm-up)."""
        self.fell = False
        """The LR went down at some step (a decay: what comes after is no warm-up)."""
        self.trained = 0.0
        """The sum of the LR over the steps before `since` (how far the run has trained)."""
        self.since: int | None = None
        """The step from which `last` was used."""

    def see(self, step: int, lr: float | None) -> Jump | None:
        """The LR `lr` of step `step` (before any policy scales it), called when it differs
        from the last one: a `Jump` when it is `JUMP` x the last one or more and neither a
        restart nor a warm-up (the module docstring), else None."""
        last, loaded = self.last, self.loaded
        if last is not None and self.since is not None and math.isfinite(last) and last > 0:
            self.trained += last * max(step - self.since, 0)
        self.last, self.loaded, self.since = lr, False, step
        if lr is None or not math.isfinite(lr):
            return None
        peak, fell = self.peak, self.fell
        self.peak = max(peak, lr)
        if last is None or not math.isfinite(last) or last <= 0:
            return None
        self.fell = fell or lr < last
        if lr < JUMP * last:
            return None
        if not loaded and (lr <= RETURN * peak or not (self.resumed or fell) and (
                last * WARM_FROM <= lr or self.trained * JUMP < lr)):
            return None  # a restart, or a warm-up from near 0
        self.jump = Jump(step, last, lr, loaded)
        self.jumps += 1
        return self.jump

    def load(self, lr: float | None) -> None:
        """The LR a loaded optimizer state carries (`optimizer.load_state_dict`): the LR the run
        resumed from was saved at."""
        if lr is not None and math.isfinite(lr) and lr > 0:
            self.last, self.loaded, self.resumed = lr, True, True
            self.peak = max(self.peak, lr)

    def state_dict(self) -> dict[str, Any]:
        j = self.jump
        return {"last": self.last, "jumps": self.jumps, "peak": self.peak,
                "jump": None if j is None else [j.step, j.old, j.new, j.resumed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state.get("last")
        peak = state.get("peak")
        if isinstance(peak, (int, float)) and math.isfinite(peak):
            self.peak = max(self.peak, float(peak))
        self.load(float(last) if isinstance(last, (int, float)) else None)
        self.jumps = int(state.get("jumps", 0))
        j = state.get("jump")
        self.jump = None if not j else Jump(int(j[0]), float(j[1]), float(j[2]), bool(j[3]))
