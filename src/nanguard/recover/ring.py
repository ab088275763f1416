"""A small ring of last good states, within a memory budget the user sets.

One snapshot is not enough: refreshed every few quiet steps, the newest one may already sit
inside the lead-up to a failure (a loss that has been climbing for five steps before the
divergence alarm, momentum growing for three before the cascade alarm). Rolling back to it
would replay the failure; rolling back to step 0 throws away all progress. The ring keeps up to
`RecoverConfig.snapshot_slots` snapshots (by default two: one recent, one older), and a rollback
restores the newest one taken before the trouble began (`restore(before=...)`).

Memory: each slot is one host copy of what the optimizer trains (`HostSnapshot`). Slots beyond
the first are kept only while the ring's total stays within `RecoverConfig.snapshot_budget_mb`;
the first is always kept, since a rollback cannot work without it. A full ring refreshes its
oldest slot in place (its buffers are reused, nothing is allocated).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nanguard.recover.snapshot import HostSnapshot


class SnapshotRing:
    """Up to `slots` snapshots of `model` / `optimizer`, oldest first, within `budget_bytes`.

    Args:
        model, optimizer, extras: what each `HostSnapshot` copies.
        slots: the most snapshots kept (>= 1).
        budget_bytes: the most host memory all slots may hold together; None: no limit beyond
            `slots`. The newest slot is kept even when it alone exceeds the budget
            (`over_budget` then says so).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: dict[str, Any] | None = None,
        *,
        slots: int = 2,
        budget_bytes: int | None = None,
    ) -> None:
        self._args = (model, optimizer, extras)
        self.max_slots = max(1, slots)
        self.budget_bytes = budget_bytes
        self.slots: list[HostSnapshot] = []  # oldest first
        self.current: HostSnapshot | None = None  # the one a rollback restored last

    def capture(self, step: int, *, in_step: bool = True) -> None:
        """Take a snapshot of the state at the start of `step` into the ring (see
        `HostSnapshot.capture` for `in_step`): a new slot while there is room, else the oldest
        slot refreshed in place. Then drop the oldest slots while the ring exceeds the budget."""
        fresh = not self.slots or self._room()
        snap = HostSnapshot(*self._args) if fresh else self.slots.pop(0)
        snap.capture(step, in_step=in_step)
        self.slots.append(snap)
        self.current = None
        while len(self.slots) > 1 and not self._within_budget():
            self.slots.pop(0)  # its buffers are freed with it

    def _room(self) -> bool:
        if len(self.slots) >= self.max_slots:
            return False
        if self.budget_bytes is None:
            return True
        # A new slot holds about as much as the newest (the same parameters and state).
        return self.nbytes + self.slots[-1].nbytes <= self.budget_bytes

    def _within_budget(self) -> bool:
        return self.budget_bytes is None or self.nbytes <= self.budget_bytes

    def restore(self, before: int | None = None) -> int:
        """Restore the newest snapshot taken at or before step `before` (None: the newest of
        all); the oldest when none is that old. Snapshots newer than the one restored are
        dropped: they belong to the steps the rollback discards. Returns its step."""
        assert self.slots, "restore() before capture()"
        chosen = self.slots[0]
        for snap in self.slots:
            if before is None or (snap.step is not None and snap.step <= before):
                chosen = snap
        del self.slots[self.slots.index(chosen) + 1:]
        self.current = chosen
        return chosen.restore()

    def reapply(self) -> None:
        """`HostSnapshot.reapply` of the snapshot restored last."""
        if self.current is not None:
            self.current.reapply()

    @property
    def newest(self) -> HostSnapshot:
        return self.slots[-1]

    @property
    def step(self) -> int | None:
        """Step of the newest snapshot."""
        return self.newest.step if self.slots else None

    @step.setter
    def step(self, value: int) -> None:
        self.newest.step = value

    @property
    def in_step(self) -> bool:
        """Whether the last restored snapshot (else the newest) was taken inside a step."""
        snap = self.current or (self.newest if self.slots else None)
        return True if snap is None else snap.in_step

    @property
    def steps(self) -> list[int]:
        """Steps of the snapshots held, oldest first."""
        return [s.step for s in self.slots if s.step is not None]

    @property
    def nbytes(self) -> int:
        """Host memory held by all slots together."""
        return sum(s.nbytes for s in self.slots)

    @property
    def over_budget(self) -> bool:
        """The one slot kept alone exceeds the budget (a rollback needs at least one)."""
        return not self._within_budget()
