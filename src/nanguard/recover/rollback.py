"""The `rollback` policy's bookkeeping: when to refresh the snapshot, the LR backoff, giving up.

The guard calls, per step: `backoff_on` in its pre-hook (scales this step's LR; first settles a
rollback to the initial snapshot), `backoff_off` in its post-hook (puts the scheduler's LR back,
so schedulers keep working), `maybe_capture` once the step is known healthy, and `rollback` on an
alarm that the policy acts on.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from nanguard.config import RecoverConfig
from nanguard.recover.snapshot import HostSnapshot


class GiveUp(Exception):
    """Too many rollbacks within the window: training should stop with the report."""


class Rollback:
    """Args:
    config: rollback settings.
    snapshot: where the last good state lives.
    optimizer: whose LR is backed off.
    """

    def __init__(
        self, config: RecoverConfig, snapshot: HostSnapshot, optimizer: torch.optim.Optimizer
    ) -> None:
        self.config = config
        self.snapshot = snapshot
        self.optimizer = optimizer
        self.history: deque[int] = deque()  # steps at which we rolled back
        self.backoff_until = -1
        self.factor = 1.0
        self._saved_lrs: list[Any] | None = None
        self.last_unhealthy = -(10**9)
        self._reapply = False  # restored a between-steps snapshot: settle it at the next update

    def maybe_capture(self, next_step: int, healthy: bool) -> bool:
        """After a step: refresh the snapshot every `snapshot_every` steps, but only from a state
        with no warning in the last `quiet_steps` steps (never from inside a cascade)."""
        if not healthy:
            self.last_unhealthy = next_step - 1
            return False
        if next_step % self.config.snapshot_every:
            return False
        if next_step - self.last_unhealthy <= self.config.quiet_steps:
            return False
        self.snapshot.capture(next_step)
        return True

    def rollback(self, step: int, *, forced: bool = False, early: bool = False) -> int:
        """Restore the last good state; back the LR off as far as the evidence calls for.
        Raises GiveUp past `max_rollbacks`, unless `forced` (following another optimizer's
        rollback: that one decides giving up).

        `early`: acting on an early warning (a spike, a cascade), nothing non-finite yet. The
        first such rollback in the window keeps the LR: the batch that started it is left out
        (training goes on with the next batches), and one outlier batch is no evidence that
        the LR is too high. A non-finite value, or a second rollback within the window, is:
        x`backoff_factor`, compounding."""
        while self.history and step - self.history[0] > self.config.window:
            self.history.popleft()
        if len(self.history) >= self.config.max_rollbacks and not forced:
            raise GiveUp(
                f"{len(self.history)} rollbacks within {self.config.window} steps; giving up"
            )
        self.history.append(step)
        restored = self.snapshot.restore()
        self._reapply = not self.snapshot.in_step
        # Step `step` makes no update: the next `backoff_steps` steps are backed off.
        self.backoff_until = step + 1 + self.config.backoff_steps
        # Compounding: a second failure within the window backs off further (x0.25, ...).
        self.factor = self.config.backoff_factor ** (len(self.history) - (1 if early else 0))
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
            "factor": self.factor,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque(int(s) for s in state["history"])
        self.backoff_until = int(state["backoff_until"])
        self.last_unhealthy = int(state["last_unhealthy"])
        self.factor = float(state["factor"])
