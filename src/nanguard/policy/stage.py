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

from dataclasses import asdict, dataclass
from typing import Any, Literal

from nanguard.detect import Alarm, bad_batch
from nanguard.policy.recurrence import (
    INSTABILITY,
    Recurrence,
    hold_sentence,
    instability_only,
    ruled_out_sentence,
    traced,
)
from nanguard.watch.stats import StepStats

Action = Literal["none", "skip", "discard_spike", "rollback", "escalate", "cannot_skip",
                 "raise", "hold"]
Verdict = Literal["hold", "lone", "escalate"] | None


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What the Guard must do about one step."""

    action: Action
    """`none`: nothing. `skip`: discard this update. `discard_spike`: discard this update, the
    state before it is still good (no rollback, no LR change). `rollback`: restore a snapshot.
    `escalate`: skipping does not heal the run (too many skips in a row): roll back if
    configured, else stop. `cannot_skip`: the update itself went non-finite (escalate if
    configured, else record that it could not be skipped). `raise`: stop the run. `hold`: a
    spike of a recurring instability (`policy.recurrence`): the update goes ahead, `why` says
    why (recorded as a `not_skipped` action when `say`)."""
    why: str
    """The alarms or non-finite signals behind it, for `actions[].detail`."""
    lone: Recurrence | None = None
    """A `skip` / `discard_spike` of a lone spike not traced to its batch: the policy's
    memory of such spikes, for the check that needs the guard's last LR jump
    (`policy.act`: a spike right after a jump is held, not skipped)."""
    say: bool = True
    """`hold`: record and say why (the first hold of an instability; its later ones are
    silent)."""


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
    recurrence: Recurrence | None = None
    """The unexplained spikes seen (`policy.recurrence`): `skip`, `heal` and `rollback`."""

    def __init__(self, acting_on: tuple[str, ...], max_consecutive_skips: int = 10) -> None:
        self.acting_on = acting_on
        self.max_consecutive_skips = max_consecutive_skips

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        """The decision for a step that `wants_to_act` flagged (and every rank agreed on)."""
        return Decision(action="none", why=reason(stats, alarms))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed guard's policy needs to decide as this one would (`guard_state`):
        the spikes of a recurring instability it has seen (`policy.recurrence`)."""
        return {} if self.recurrence is None else {"recurrence": asdict(self.recurrence)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a state of another policy: what fits)."""
        if self.recurrence is not None and state.get("recurrence"):
            self.recurrence = Recurrence(**state["recurrence"])

    def verdict(self, stats: StepStats, alarms: list[Alarm], *, skips_in_row: int) -> Verdict:
        """What `decide` (before the update) will make of this step's spike, without changing
        the policy's memory: `hold` (its update goes ahead: a recurring instability's spike),
        `lone` (discarded as a lone spike, unless `policy.act.lone_held` keeps it),
        `escalate` (an unexplained spike after too many discarded updates in a row), or None
        (not a spike `policy.recurrence` weighs).
        Under torch.distributed it is agreed across ranks before deciding (`step.acting`)."""
        return None

    def overruled(self, held: Decision, stats: StepStats, alarms: list[Alarm], *,
                  skips_in_row: int) -> Decision:
        """Under torch.distributed, the decision instead of `held` (this rank would let the
        update go ahead) when another rank discards it: one traced the spike to its own batch,
        or saw it lone. Every rank then discards it, as that rank's policy does."""
        return held


class Raise(Policy):
    """`raise`: stop at the first step that calls for acting."""

    name = "raise"

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        return Decision(action="raise", why=reason(stats, alarms))


def _unexplained(stats: StepStats, alarms: list[Alarm], kinds: tuple[str, ...]) -> bool:
    """A step acted on for spikes (or cascades, when `kinds` has them) alone, nothing
    non-finite, not traced to its batch: a discarded update answers it only when it is lone
    (`policy.recurrence`).

    Under torch.distributed a rank's trace of its own batch (its loss, its rows) is not the
    other ranks': a hold is agreed (`step.acting`), and the update goes ahead only when every
    rank that acts would hold it; otherwise every rank discards it (`overruled`), so the
    replicas stay together."""
    return (instability_only(alarms, kinds) and not traced(alarms)
            and not [s for s in stats.seal() if s != "data"])


class Skip(Policy):
    """`skip`: discard the update of a bad step; after `max_consecutive_skips` discarded in a
    row, skipping does not heal the run: escalate. A value the update itself made non-finite
    cannot be skipped any more. A spike is skipped when it was traced to its batch or is lone;
    a spike of a recurring instability, or a cascade, is held (`policy.recurrence`)."""

    name = "skip"
    recurrence: Recurrence

    def __init__(self, acting_on: tuple[str, ...], max_consecutive_skips: int = 10) -> None:
        super().__init__(acting_on, max_consecutive_skips)
        self.recurrence = Recurrence()

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        why = reason(stats, alarms)
        if post:
            if (all(a.kind in INSTABILITY for a in alarms if a.kind in self.acting_on)
                    and stats.agreed_bad_rank is None
                    and not [s for s in stats.seal() if s.startswith(("param", "optimizer"))]):
                # A cascade the post-update detectors saw (of activations), here or on another
                # rank, and nothing non-finite on any: nothing the update made non-finite
                # ("cannot skip" would claim so), nothing a skip could do. (Every rank decides
                # alike: a rank without the alarm has none, and `agreed_bad_rank` is agreed.)
                return Decision(action="none", why=why)
            # Discarded already (the values were bad before the update): nothing more to do.
            return Decision(action="none" if stats.skipped else "cannot_skip", why=why)
        held, lone = _weigh(self.recurrence, stats, alarms,
                            self.verdict(stats, alarms, skips_in_row=skips_in_row))
        if held is not None:
            return held
        if skips_in_row >= self.max_consecutive_skips:
            return Decision(action="escalate", why=why)
        return Decision(action="skip", why=why, lone=lone)

    def verdict(self, stats: StepStats, alarms: list[Alarm], *, skips_in_row: int) -> Verdict:
        if not _unexplained(stats, alarms, self.acting_on):
            return None
        if (self.recurrence.peek(stats.step) > 1 or bad_batch.ruled_out(alarms)
                or any(a.kind == "cascade" for a in alarms if a.kind in self.acting_on)):
            return "hold"
        return "lone" if skips_in_row < self.max_consecutive_skips else "escalate"

    def overruled(self, held: Decision, stats: StepStats, alarms: list[Alarm], *,
                  skips_in_row: int) -> Decision:
        _unsay(held, self.recurrence)
        why = f"{reason(stats, alarms)}; {_OVERRULED}"
        if skips_in_row >= self.max_consecutive_skips:
            return Decision(action="escalate", why=why)
        return Decision(action="skip", why=why)


_OVERRULED = ("discarded with the other ranks: another rank traced the spike to its own batch "
              "or saw it lone")


def _unsay(held: Decision, rec: Recurrence) -> None:
    """A hold another rank overruled was not said: the instability's next hold says it."""
    if held.action == "hold" and held.say:
        rec.said = False


def _weigh(rec: Recurrence, stats: StepStats, alarms: list[Alarm], verdict: Verdict
           ) -> tuple[Decision | None, Recurrence | None]:
    """Note an unexplained spike's `verdict` (`Policy.verdict`) in `rec`: the hold, or for a
    lone spike the memory its discard hands on (`Decision.lone`); (None, None) for a step
    `policy.recurrence` does not weigh."""
    if verdict is None:
        return None, None
    rec.see(stats.step)
    if verdict == "hold":
        return _hold(stats, alarms, rec), None
    return None, rec if verdict == "lone" else None


def _hold(stats: StepStats, alarms: list[Alarm], rec: Recurrence) -> Decision:
    """Leave the update of a recurring instability's spike alone; say why once."""
    say, rec.said = not rec.said, True
    why = (ruled_out_sentence(stats.step, alarms)
           if rec.count <= 1 and bad_batch.ruled_out(alarms)
           else hold_sentence(stats.step, rec, alarms))
    return Decision(action="hold", why=why, say=say)


class Rollback(Policy):
    """`rollback`: restore the last good snapshot. A spike seen before its update (and nothing
    else acted on, nothing non-finite) only needs that update discarded when it was traced
    to its batch or is lone: the state is good. A spike of a recurring instability is held
    (`policy.recurrence`; a cascade is rolled back, with the LR backed off)."""

    name = "rollback"
    recurrence: Recurrence

    def __init__(self, acting_on: tuple[str, ...], max_consecutive_skips: int = 10) -> None:
        super().__init__(acting_on, max_consecutive_skips)
        self.recurrence = Recurrence()

    def decide(self, stats: StepStats, alarms: list[Alarm], *, post: bool,
               skips_in_row: int) -> Decision:
        why = reason(stats, alarms)
        acting = {a.kind for a in alarms if a.kind in self.acting_on}
        nonfinite = [s for s in stats.seal() if s != "data"]
        if not post and acting <= {"spike"} and not nonfinite:
            held, lone = _weigh(self.recurrence, stats, alarms,
                                self.verdict(stats, alarms, skips_in_row=skips_in_row))
            return held or Decision(action="discard_spike", why=why, lone=lone)
        return Decision(action="rollback", why=why)

    def verdict(self, stats: StepStats, alarms: list[Alarm], *, skips_in_row: int) -> Verdict:
        if not ({a.kind for a in alarms if a.kind in self.acting_on} <= {"spike"}
                and _unexplained(stats, alarms, ("spike",))):
            return None
        if self.recurrence.peek(stats.step) > 1 or bad_batch.ruled_out(alarms):
            return "hold"
        return "lone"

    def overruled(self, held: Decision, stats: StepStats, alarms: list[Alarm], *,
                  skips_in_row: int) -> Decision:
        _unsay(held, self.recurrence)
        return Decision(action="discard_spike", why=f"{reason(stats, alarms)}; {_OVERRULED}")


class Heal(Skip):
    """`heal`: decides like `skip` (discard a non-finite update); its loss-spike side acts in
    `recover.heal` before every update, not on alarms."""

    name = "heal"


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Policy, Raise, Skip, Rollback, Heal)}


def make_policy(name: str, acting_on: tuple[str, ...], max_consecutive_skips: int = 10
                ) -> Policy:
    """The policy object for `GuardConfig.policy` (validated there)."""
    return POLICIES[name](acting_on, max_consecutive_skips)
