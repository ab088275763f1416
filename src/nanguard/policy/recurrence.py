"""Which spike a discarded update answers: a bad batch's or a lone one, not an instability's.

Skipping a step's update answers a *batch*: the update it discards is the one that batch made,
and the next batch trains from the state before it. A spike the guard traced to its batch
(`detect.bad_batch`: its own loss an outlier, or a few rows carrying its gradient, after a
quiet step at a steady LR) is that case, and so is a lone spike after quiet steps: one step
went wrong, the state before it is still good.

A spike of a recurring instability is not: an optimizer whose LR x weight-decay product (or
whose LR alone) is too high, a cascade feeding its own growth back, the steps after an LR jump
without warm-up; nor is a spike whose batch its replay ruled out (every row measured before
the update, none standing out: `detect.bad_batch.ruled_out`), even a lone one. The state the
next batch trains from is the one that spiked already; discarding update after update stalls
training while the instability goes on (issue 40: nanoGPT's `lr_wd` seed 0 under `skip`
discarded the updates of three spikes 5 steps apart and never recovered, 93% of its steps in
spike against plain training's 4%; discarding only the first, lone one: 74%). There the policy
records, and says once per instability, why it did not skip, and leaves the update alone: the
status stays `warned`, and `heal` (or clipping) is the answer it names.

`Recurrence` is the memory this needs (the steps of the unexplained spikes the policy was asked
about; saved with the guard's state, `Policy.state_dict`); the rules are pure
functions of it, the step's alarms, and what the policy is not asked about, which
`policy.act` hands in from recovery: the LR jump the guard last saw (`policy.lr_change`) and
the spikes it logged (a loss spike not traced to its batch raises no decision). Nothing here
holds a reference to the guard. Without a replay a lone spike cannot be told from a bad batch's and
is discarded, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanguard.detect import Alarm, bad_batch
from nanguard.policy.lr_change import FOLLOWS, Jump

RECUR_STEPS = 20
"""An unexplained spike (or cascade) within this many steps of the one before is the same
instability recurring, not a lone bad step. An instability spikes step after step, and the
spike cooldown (`DetectConfig.spike_cooldown`, 5) silences the 4 steps after each alarm: its
alarms come 5 steps apart (nanoGPT's `lr_wd`: 251, 256, 261). Bad samples come alone: two
untraced outliers 27 steps apart (the cascade scenario's seed 8, no replay to trace them) are
two lone spikes, each skipped. Spikes traced to their batches never count towards it."""

INSTABILITY = ("spike", "cascade")
"""The alarm kinds a recurring instability raises that a discarded update does not answer.
Others acted on (overflow, forecast, non-finite values) are discarded as before: the update
they would let through is about to leave the dtype's range."""


@dataclass
class Recurrence:
    """The unexplained spikes one policy has seen (see the module docstring)."""

    last: int | None = None
    """The step of the last one."""
    first: int | None = None
    """The first step of the current run of them (each within `RECUR_STEPS` of the one
    before)."""
    count: int = 0
    """How many in the current run, this one included."""
    said: bool = False
    """The current run's first hold was recorded and said."""

    def peek(self, step: int) -> int:
        """How many of the current run an unexplained spike at `step` would make (`see`
        without seeing it)."""
        return 1 if self._new_run(step) else self.count + 1

    def see(self, step: int) -> int:
        """An unexplained spike at `step`: how many of the current run it makes."""
        if self._new_run(step):
            self.first, self.count, self.said = step, 0, False
        self.last = step
        self.count += 1
        return self.count

    def _new_run(self, step: int) -> bool:
        return self.last is None or step - self.last > RECUR_STEPS or step < self.last


def instability_only(alarms: list[Alarm], acting_on: tuple[str, ...]) -> bool:
    """Whether the alarms acted on are all spikes or cascades (and there is one)."""
    kinds = {a.kind for a in alarms if a.kind in acting_on}
    return bool(kinds) and kinds <= set(INSTABILITY)


def traced(alarms: list[Alarm]) -> bool:
    """Whether the spike detector (or the spike's replay) traced the step to its batch."""
    return bad_batch.is_bad_batch(alarms)


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _what(alarms: list[Alarm]) -> str:
    """The alarms of a held step, named for the sentence ("grad-norm spike", "cascade")."""
    if any(a.kind == "cascade" for a in alarms):
        return "cascade"
    signals = sorted({a.signal for a in alarms if a.kind == "spike"})
    return ("grad-norm" if signals == ["grad_norm"] else "loss" if signals == ["loss"]
            else "grad-norm and loss") + " spike"


_ANSWER = ("discarding this update would not answer it: the next batch trains from the same "
           "state; recorded, not acted on, and so are its later spikes (each within "
           f"{RECUR_STEPS} steps of the one before); policy='heal' corrects the LR or weight "
           "decay behind it, clip_grad_norm_ bounds each update")


def hold_sentence(step: int, rec: Recurrence, alarms: list[Alarm]) -> str:
    """Why the update of `step` (a spike of a recurring instability) was not skipped."""
    what = _what(alarms)
    if rec.count <= 1:  # a cascade on its own
        return (f"update kept: a {what} at step {step}, not traced to a batch: the optimizer "
                f"feeding its own growth back, {_ANSWER}")
    first = rec.first if rec.first is not None else step
    return (f"update kept: the {_ordinal(rec.count)} {what} in {step - first + 1} steps "
            f"(since step {first}), none traced to a batch: an optimizer instability, "
            f"{_ANSWER}")


def ruled_out_sentence(step: int, alarms: list[Alarm]) -> str:
    """Why the update of a lone spike whose batch's replay ruled the batch out
    (`detect.bad_batch.ruled_out`) was not skipped."""
    return (f"update kept: the {_what(alarms)} at step {step} is not its batch's: replayed "
            f"row by row before its update, no row's gradient or loss stands "
            f"{bad_batch.ROW_Z:g} sigma above the others (the gradient rose in every row "
            f"together: the weights moved to where any batch's gradient is large); {_ANSWER}")


def after_spikes(step: int, spikes: list[dict[str, Any]]) -> str | None:
    """Why a spike at `step` the policy took for lone is not: the guard logged another spike
    (`spikes`: report.json's, either signal, one no policy acted on included: a loss spike not
    traced to its batch) in the `RECUR_STEPS` steps before it, not traced to its batch either
    (None when it logged none). Its steps were not quiet: the spike is a recurrence."""
    for entry in reversed(spikes):
        k = entry.get("step")
        if not isinstance(k, int) or k >= step:
            continue  # this step's own entry
        if step - k > RECUR_STEPS:
            return None
        if entry.get("alarm") is None and entry.get("cause") != bad_batch.BAD_BATCH:
            return (f"update kept: a spike at step {step}, {step - k} step(s) after the spike "
                    f"at step {k}, neither traced to a batch: not after quiet steps, a "
                    f"recurring instability; {_ANSWER}")
    return None


def after_jump(step: int, jump: Jump | None) -> str | None:
    """Why an unexplained spike at `step` is the LR jump's, not a batch's (None when no jump
    was seen in the `FOLLOWS` steps before it)."""
    if jump is None or not 0 <= step - jump.step < FOLLOWS:
        return None
    return (f"update kept: a spike {step - jump.step} step(s) after {jump.text()}, not "
            "traced to a batch: the optimizer's state (Adam's moments, a momentum) still "
            "holds the old step size, and discarding updates does not bring it up to the new "
            "one; recorded, not acted on, and so are the spikes after it; policy='heal' ramps "
            f"the LR back up from {jump.old:.3g}")
