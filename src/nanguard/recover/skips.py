"""An honest skip: what a discarded update left as it was, and what it could not.

A skipped update (`skip`, `heal` on a non-finite step, a batch left out after a rollback, a
fused optimizer's `found_inf`) leaves the parameters, the optimizer's moments and its step
counter as they were: the guard takes the gradients away before `optimizer.step()` and
torch's optimizers leave a parameter without a gradient untouched, `state['step']` included
(fused ones subtract their `found_inf` from it). The script's LR scheduler is the script's:
its `scheduler.step()` after the skipped update still runs. `SkipLedger` keeps that honest:

- every skip is counted, with its step and the batch that caused it (`batch_note`: the first
  fingerprints of its samples and the non-finite rows; run.db's `batches` table holds them all);
- with the scheduler given to the guard (`Guard(..., scheduler=...)`) and stepped once per
  update (its `last_epoch` keeps up with the updates), the step it took for a skipped update is
  taken back before the next update: its state and the groups' LRs as at the skip. The run then
  matches one that never saw the batch, LR schedule included;
- otherwise, when the LR moved between a skipped update and the next one, the report says
  that the schedule advanced for it (`run.recovery.skips`).

Cost: nothing on a step without a skip (one attribute check in the next step's pre-hook).
"""

from __future__ import annotations

from typing import Any

from nanguard.watch.stats import StepStats


def batch_note(stats: StepStats) -> str:
    """The batch of a skipped step, for the action's detail: its first sample fingerprints
    and non-finite rows ("" when the guard was handed no batch)."""
    hashes = list(stats.sample_hashes)
    if not hashes:
        return ""
    rows = stats.nonfinite_samples
    shown = ", ".join(f"{h:#x}" for h in hashes[:3]) + (", ..." if len(hashes) > 3 else "")
    return (f"; batch of {len(hashes)} sample(s), fingerprint(s) {shown}"
            + (f", non-finite row(s) {rows[:8]}" if rows else ""))


class SkipLedger:
    """Args:
    scheduler: the LR scheduler given to the guard (None: none given).
    optimizer: the guard's optimizer (its groups' LRs).
    """

    def __init__(self, scheduler: Any, optimizer: Any) -> None:
        self.scheduler = scheduler if hasattr(scheduler, "state_dict") else None
        self.optimizer = optimizer
        self.steps: list[int] = []  # every skipped update's step
        self.held = 0  # scheduler steps taken back
        self.advanced: list[int] = []  # skipped updates the schedule advanced for
        self.pending: tuple[int, float | None, Any, list[float]] | None = None
        """The last skip, until the next update: (step, LR, scheduler state, groups' LRs)."""

    def skipped(self, step: int, lr: float | None, *, hold: bool = True) -> None:
        """The update of `step` was discarded (called once per skipped update). `hold`: the
        scheduler has not stepped since (the skip is seen in its own step), and the discard
        is a skip, not a rollback's (a rollback restores the scheduler with the model)."""
        if self.steps and self.steps[-1] == step:
            return
        self.steps.append(step)
        sched = self.scheduler
        state = None
        if (hold and sched is not None and step > 0
                and getattr(sched, "last_epoch", -1) + self.held >= step):
            # Stepped once per update so far (an epoch scheduler falls behind the steps from
            # the second; at the first the two look alike: not held, reported if it moved).
            state = sched.state_dict()
        self.pending = (step, lr, state, [g["lr"] for g in self.optimizer.param_groups])

    def before_next(self, lr: float | None) -> float | None:
        """The next update's pre-hook (its LR `lr` as the schedule set it): take back a
        scheduler step made for the skipped update, else note that the LR moved. Returns the
        LR the update uses now."""
        assert self.pending is not None
        step, was, state, lrs = self.pending
        self.pending = None
        sched = self.scheduler
        if state is not None and sched is not None and \
                getattr(sched, "last_epoch", None) == state.get("last_epoch", 0) + 1:
            sched.load_state_dict(state)
            for g, v in zip(self.optimizer.param_groups, lrs, strict=True):
                g["lr"] = v
            self.held += 1
            return lrs[0] if lrs else lr
        if lr != was:
            self.advanced.append(step)
        return lr

    def cost(self) -> dict[str, Any] | None:
        """`run.recovery.skips`: how many updates were skipped, whether the LR schedule was
        held for them, and for which it advanced anyway (None without a skip)."""
        if not self.steps:
            return None
        n = len(self.steps)
        note = (f"the LR schedule was held for {self.held} of {n} skipped update(s)"
                if self.held else "")
        if self.advanced:
            note += ("; " if note else "") + (
                f"the LR moved after {len(self.advanced)} skipped update(s) (steps "
                f"{self.advanced[:8]}): the script's schedule advanced for them, so the run's "
                "schedule is ahead of one that never saw those batches (an LR scheduler given "
                "to the guard, `Guard(..., scheduler=...)`, is held; an LR the script sets "
                "from its own iteration count, as nanoGPT's get_lr, cannot be)")
        return {"count": n, "steps": self.steps[:50], "schedule_held": self.held,
                "schedule_advanced": self.advanced[:50], "note": note or
                "the LR did not move across any skipped update"}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "held": self.held, "advanced": list(self.advanced)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = [int(s) for s in state.get("steps", [])]
        self.held = int(state.get("held", 0))
        self.advanced = [int(s) for s in state.get("advanced", [])]
