"""The `rollback` policy's bookkeeping: when to refresh the snapshots, which one to restore, the
LR backoff, giving up.

The guard calls, per step: `backoff_on` in its pre-hook (scales this step's LR; first settles a
rollback to the initial snapshot), `backoff_off` in its post-hook (puts the scheduler's LR back,
so schedulers keep working), `maybe_capture` once the step is read, and `rollback` on an alarm
that the policy acts on. How far the LR is backed off is `nanguard.recover.backoff`'s call.

Which state a rollback returns to: the newest snapshot taken before the trouble began. An
episode is a run of alarmed steps with fewer than `quiet_steps` quiet steps between them; it
began where its first alarm's evidence began (`trouble_start`: a divergence alarm averages the
last `divergence_steps` losses, a cascade counts `cascade_steps` steps of growth).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from nanguard.config import DetectConfig, RecoverConfig
from nanguard.detect.alarm import Alarm
from nanguard.recover.backoff import Backoff, GrowthTrail
from nanguard.recover.ring import SnapshotRing


def trouble_start(step: int, alarms: list[Alarm], detect: DetectConfig) -> int:
    """The first step whose state the alarms of `step` cast doubt on: the step itself for an
    event seen within it (a NaN, a spike, an overflow: the state before its update is good),
    earlier for alarms whose evidence spans several steps."""
    back = 0
    for a in alarms:
        if a.kind == "divergence":
            back = max(back, detect.divergence_steps)
        elif a.kind in ("cascade", "forecast"):
            back = max(back, detect.cascade_steps)
    return step - back


class GiveUp(Exception):
    """Too many rollbacks within the window: training should stop with the report."""


class Rollback:
    """Args:
    config: rollback settings.
    snapshot: where the last good states live.
    optimizer: whose LR is backed off.
    """

    def __init__(
        self, config: RecoverConfig, snapshot: SnapshotRing, optimizer: torch.optim.Optimizer
    ) -> None:
        self.config = config
        self.snapshot = snapshot
        self.optimizer = optimizer
        self.history: deque[int] = deque()  # steps at which we rolled back
        self.backoff_until = -1
        self.factor = 1.0
        self.repeat = False  # the last rollback compounded with an earlier one...
        self.compounded = 1.0  # ...whose factor was this
        self.trail = GrowthTrail()  # the recent magnitudes: the evidence for the backoff
        self._saved_lrs: list[Any] | None = None
        self.last_unhealthy = -(10**9)
        self.episode_from = -(10**9)  # where the trouble of the current episode began
        self._reapply = False  # restored a between-steps snapshot: settle it at the next update

    def _bound(self, step: int, trouble_from: int) -> int:
        """Where the trouble of the episode that `step` (alarmed) belongs to began."""
        if step - self.last_unhealthy > self.config.quiet_steps:
            return trouble_from  # a new episode
        return min(self.episode_from, trouble_from)

    def maybe_capture(self, next_step: int, healthy: bool, trouble_from: int | None = None) -> bool:
        """After a step: refresh a snapshot every `snapshot_every` steps, but only from a state
        with no warning in the last `quiet_steps` steps (never from inside a cascade). An
        unhealthy step extends the current episode (`trouble_from`: where its evidence began,
        see `trouble_start`; default the step itself)."""
        if not healthy:
            step = next_step - 1
            self.episode_from = self._bound(step, step if trouble_from is None else trouble_from)
            self.last_unhealthy = step
            return False
        if next_step % self.config.snapshot_every:
            return False
        if next_step - self.last_unhealthy <= self.config.quiet_steps:
            return False
        self.snapshot.capture(next_step)
        return True

    def rollback(self, step: int, *, forced: bool = False, backoff: Backoff | None = None,
                 trouble_from: int | None = None) -> int:
        """Restore the newest snapshot from before the episode's trouble began (`trouble_from`:
        where the evidence of this step's alarms began; None: the newest snapshot); back the
        LR off as far as the evidence calls for. Raises GiveUp past `max_rollbacks`, unless
        `forced` (following another optimizer's rollback: that one decides giving up).

        `backoff`: this event's own factor and its evidence (`nanguard.recover.backoff.decide`;
        None: the configured `backoff_factor`). A rollback within `window` steps of an
        earlier one compounds: the factor is the earlier one's times the smaller of this
        event's and `backoff_factor` (training keeps failing, whatever the cause). `forced`
        rollbacks take the factor given as it is (the other optimizer compounded already)."""
        while self.history and step - self.history[0] > self.config.window:
            self.history.popleft()
        if len(self.history) >= self.config.max_rollbacks and not forced:
            raise GiveUp(
                f"{len(self.history)} rollbacks within {self.config.window} steps; giving up"
            )
        own = self.config.backoff_factor if backoff is None else backoff.factor
        self.repeat = bool(self.history) and not forced and self.config.backoff_factor < 1.0
        if self.repeat:
            self.compounded = self.factor
            own = self.factor * min(own, self.config.backoff_factor)
        self.history.append(step)
        before = None if trouble_from is None else self._bound(step, trouble_from)
        restored = self.snapshot.restore(before)
        self._reapply = not self.snapshot.in_step
        # Step `step` makes no update: the next `backoff_steps` steps are backed off.
        self.backoff_until = step + 1 + self.config.backoff_steps
        self.factor = own
        if before is not None:
            self.episode_from = before
        self.last_unhealthy = step
        return restored

    def backoff_on(self, step: int) -> None:
        """Pre-hook: scale this step's LR while backing off (the scheduler's value is kept).

        First, after a rollback to a snapshot taken between steps, put its schedule back once
        more: the user's `scheduler.step()` after the rolled-back step moved it one step on.
        """
        if self._reapply:
            self._reapply = False
            self.snapshot.reapply()
        if step >= self.backoff_until or self.factor == 1.0:
            return
        self._saved_lrs = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * self.factor

    def backoff_off(self) -> None:
        """Post-hook: put back the LR the scheduler (or user) had set."""
        if self._saved_lrs is None:
            return
        for g, lr in zip(self.optimizer.param_groups, self._saved_lrs, strict=True):
            g["lr"] = lr
        self._saved_lrs = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "backoff_until": self.backoff_until,
            "last_unhealthy": self.last_unhealthy,
            "episode_from": self.episode_from,
            "factor": self.factor,
            "trail": self.trail.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(int(s) for s in state["history"])
        self.backoff_until = int(state["backoff_until"])
        self.last_unhealthy = int(state["last_unhealthy"])
        self.episode_from = int(state.get("episode_from", self.last_unhealthy))
        self.factor = float(state["factor"])
        self.trail.load_state_dict(state.get("trail", {}))
