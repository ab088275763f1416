"""The policy stage: what to do about a step, decided from its statistics and alarms alone.

A policy object sees one step at a time — its `StepStats` (values read on the host) and the
alarms the detectors raised on it — and returns a `Decision`. It holds no reference to the
Guard, the model or the optimizer: the Guard applies the decision (discarding the update,
handing a rollback to `recover/`, stopping the run) and records it. That keeps every rule about
*when* to act in one place, testable without a model, and every effect in the place that owns
the state.

Two moments per step (see `step.judging`: `Judge.before_update` and `after_update`):
- `post=False`: before the update, with the gradients final. Every policy can still prevent
  the update here.
- `post=True`: after the update, when parameters or optimizer state turned non-finite in the
  update itself. Only a saved copy can undo that (`rollback`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nanguard.detect import Alarm, bad_batch
from nanguard.watch.stats import StepStats

Action = Literal["none", "skip", "discard_spike", "rollback", "escalate", "cannot_skip",
                 "raise"]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the Guard must do about one step."""

    action: Action
    """`none`: nothing. `skip`: discard this update. `discard_spike`: discard this update, the
    state before it is still good (no rollback, no LR change). `rollback`: restore a snapshot.
    `escalate`: skipping does not heal the run (too many skips in a row): roll back if
    configured, else stop. `cannot_skip`: the update itself went non-finite (escalate if
    configured, else record that it could not be skipped). `raise`: stop the run."""
    why: str
    """The alarms or non-finite signals behind it, for `actions[].detail`."""


def wants_to_act(stats: StepStats, alarms: list[Alarm], acting_on: tuple[str, ...],
                 post: bool) -> bool:
    """This rank's own verdict: does this step call for the policy at all?

    Non-finite values count when `nonfinite` is acted on (after the update: only in the
    parameters or optimizer state, which the update produced); alarms count by kind. A NaN
    batch row whose step the GradScaler already skipped (`data`) leaves nothing to act on,
    nor does a loss spike whose batch is not its cause (`detect.bad_batch.actionable`).
    """
    sealed = stats.seal()
    if not sealed and not alarms:
        return False  # the quiet step: no comprehension or generator calls
    if "nonfinite" in acting_on:
        signals = [s for s in sealed if s != "data"]
        if post:
            signals = [s for s in signals if s.startswith(("param", "optimizer"))]
        if signals:
            return True
    return any(a.kind in acting_on and (a.kind, a.signal) != ("nonfinite", "data")
               and bad_batch.actionable(a) for a in alarms)


def reason(stats: StepStats, alarms: list[Alarm]) -> str:
    """`kind:signal` of the alarms (else the non-finite signals), and the rank that showed a
    non-finite value first under torch.distributed."""
    why = ", ".join(sorted({f"{a.kind}:{a.signal}" for a in alarms})) or ", ".join(stats.seal())
    why += bad_batch.describe(stats, alarms)
    if stats.agreed_bad_rank is not None:
        return f"{why or 'agreed'}; non-finite first on rank {stats.agreed_bad_rank}"
    return why or "another rank's alarm"


class Policy:
    """`observe`: never acts (the Guard does not even ask it)."""

    name = "observe"

    def __init__(self, acting_on: tuple[str, ...], max_consecutive_skips: int = 10) -> None:
        self.acting_on = acting_on
        self.max_consecutive_skips = max_consecutive_skips

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        """The decision for a step that `wants_to_act` flagged (and every rank agreed on)."""
        return Decision(action="none", why=reason(stats, alarms))


class Raise(Policy):
    """`raise`: stop at the first step that calls for acting."""

    name = "raise"

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        return Decision(action="raise", why=reason(stats, alarms))


class Skip(Policy):
    """`skip`: discard the update of a bad step; after `max_consecutive_skips` discarded in a
    row, skipping does not heal the run: escalate. A value the update itself made non-finite
    cannot be skipped any more."""

    name = "skip"

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        why = reason(stats, alarms)
        if post:
            # Discarded already (the values were bad before the update): nothing more to do.
            return Decision(action="none" if stats.skipped else "cannot_skip", why=why)
        if skips_in_row >= self.max_consecutive_skips:
            return Decision(action="escalate", why=why)
        return Decision(action="skip", why=why)


class Rollback(Policy):
    """`rollback`: restore the last good snapshot. A spike seen before its update (and nothing
    else acted on, nothing non-finite) only needs that update discarded: the state is good."""

    name = "rollback"

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        why = reason(stats, alarms)
        acting = {a.kind for a in alarms if a.kind in self.acting_on}
        nonfinite = [s for s in stats.seal() if s != "data"]
        if not post and acting <= {"spike"} and not nonfinite:
            return Decision(action="discard_spike", why=why)
        return Decision(action="rollback", why=why)


class Heal(Skip):
    """`heal`: decides like `skip` (discard a non-finite update); its loss-spike side acts in
    `recover.heal` before every update, not on alarms."""

    name = "heal"


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Policy, Raise, Skip, Rollback, Heal)}


def make_policy(name: str, acting_on: tuple[str, ...], max_consecutive_skips: int = 10
                ) -> Policy:
    """The policy object for `GuardConfig.policy` (validated there)."""
    return POLICIES[name](acting_on, max_consecutive_skips)
