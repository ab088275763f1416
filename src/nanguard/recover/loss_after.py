"""The loss right after a resume, or after an LR jump, against the loss before it.

Two moments change a run's footing in one step, and the loss over the next steps says whether
the run took it: a resume (`Guard.load_state_dict`: the state keeps the loss level the run had
when it was saved) and an LR jump without warm-up (`policy.lr_change`: the level of the steps
before the jump). `LossAfter` holds that level (the median of the last `KEEP` finite losses and
their median absolute deviation) and checks the next `WINDOW` steps: a loss far above it (`RATIO`
x it and more than `SPREAD` deviations above it) that is still above `STAYED` x it one step
later (a bad batch's own loss is back down at the next step: not the resume's, not the jump's)
is an alarm with both numbers, once:
`resume_loss` after a resume (naming an LR jump that came with it), `lr_jump_loss` after a
jump (the `lr_jump` explain rule then names the jump as the spike's cause).

A run resumed with the wrong weights shows there too, while the detectors' own windows (restored
with the rest of the state) judge every step as before the resume. Cost: one attribute check per
step outside a window (`StepState.loss_after` is None then).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from nanguard.detect.alarm import Alarm
from nanguard.policy.lr_change import Jump

KEEP = 16
"""The last finite losses whose median is the level before."""

WINDOW = {"resume": 10, "jump": 50}
"""Steps after a resume / an LR jump compared with the level before it (a resume that did not
restore the run shows in its first steps; later trouble is the detectors' to judge)."""

RATIO = 2.0
"""A loss at least this many times the level before..."""

SPREAD = 4.0
"""...and more than this many median absolute deviations above it is far above it..."""

STAYED = 1.5
"""...when the next step's loss is still at least this many times the level before."""


def loss_level(losses: Iterable[float | None]) -> dict[str, float] | None:
    """The loss level (`median`, `mad`, `n`) of the last `KEEP` finite values of `losses`
    (oldest first); None when none was finite or the median is not positive (a ratio means
    nothing there: an RL objective, a GAN's)."""
    finite = [float(x) for x in losses if x is not None and math.isfinite(x)][-KEEP:]
    if not finite:
        return None
    med = statistics.median(finite)
    if not med > 0:
        return None
    return {"median": med, "mad": statistics.median(abs(x - med) for x in finite),
            "n": float(len(finite))}


class LossAfter:
    """Args:
    level: what `loss_level` returned for the steps before.
    step: the first step after the resume, or the step of the jump.
    what: `resume` or `jump`.
    jump: the LR jump (with `jump`; after a resume, the jump that came with it is read when the
        alarm is made).
    """

    def __init__(self, level: dict[str, float] | None, step: int, what: str,
                 jump: Jump | None = None) -> None:
        # No level (a jump at a resume's first step, nothing seen before it: `nanguard run`
        # on a resumed script): the loss of that first step is the level, its forward ran
        # on the restored weights before any update at the new LR.
        self.median = float(level["median"]) if level is not None else math.nan
        self.mad = float(level.get("mad", 0.0)) if level is not None else 0.0
        self.n = int(level.get("n", 0)) if level is not None else 0
        self.step = step
        self.what = what
        self.jump = jump
        self.far: tuple[int, float] | None = None  # (step, loss) far above, to be confirmed

    @classmethod
    def resumed(cls, state: Any, step: int) -> LossAfter | None:
        """The check for a resume at `step` from a guard state's `resume` entry (None when the
        state has no loss level)."""
        level = state.get("loss") if isinstance(state, dict) else None
        if not isinstance(level, dict) or not isinstance(level.get("median"), (int, float)):
            return None
        if not level["median"] > 0:
            return None
        return cls(level, step, "resume")

    def done(self, step: int) -> bool:
        """Whether `step` is past the window (and no step in it waits for the next one)."""
        return step >= self.step + WINDOW[self.what] and self.far is None

    def see(self, step: int, loss: float | None, jump: Jump | None) -> Alarm | None:
        """Step `step`'s loss: the alarm when it is far above the level before (`jump`: the
        latest LR jump, named after a resume when it came at or after it)."""
        if loss is None or not math.isfinite(loss):
            loss = math.inf  # a non-finite loss stays far above
        if self.n == 0:  # no level: this first step's loss is it (see `__init__`)
            if step == self.step and math.isfinite(loss) and loss > 0:
                self.median, self.n = loss, 1
            else:
                self.step = -WINDOW[self.what]  # done: nothing to compare with
            return None
        far, self.far = self.far, None
        if far is not None and loss >= STAYED * self.median:
            return self._alarm(step, far, loss, jump)
        if step < self.step + WINDOW[self.what] and math.isfinite(loss) and (
                loss >= RATIO * self.median and loss > self.median + SPREAD * self.mad):
            self.far = (step, loss)
        return None

    def _alarm(self, step: int, far: tuple[int, float], loss: float, jump: Jump | None
               ) -> Alarm:
        ratio = far[1] / self.median
        level = (f"the median of its last {self.n} steps" if self.n > 1 else
                 f"the loss of step {self.step}, before any update at the new LR")
        rose = (f"the loss rose to {far[1]:.4g} at step {far[0]} (and was {loss:.4g} at step "
                f"{step}), {far[0] - self.step} step(s) after")
        if self.what == "jump" and self.jump is not None:
            return Alarm(
                step=step, kind="lr_jump_loss", signal="loss", value=ratio,
                message=f"{rose} {self.jump.text()}: {ratio:.3g}x the loss before the jump "
                f"({self.median:.4g}, {level})")
        named = (f"; {jump.text()}" if jump is not None and self.step <= jump.step <= step
                 else "")
        return Alarm(
            step=step, kind="resume_loss", signal="loss", value=ratio,
            message=f"{rose} the resume at step {self.step}: {ratio:.3g}x the loss recorded at "
            f"save ({self.median:.4g}, {level}){named}")
