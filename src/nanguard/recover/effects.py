"""What a policy or recovery decided to do to the run, as data the Guard applies.

Recovery and the policy stage never call back into the guard: they return a list of effects,
and the guard applies them in order (`Guard.apply`). A `Stop` ends the list: applying it closes
the run and raises `NanguardError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from nanguard.detect.alarm import Alarm
from nanguard.watch.stats import StepStats


@dataclass(frozen=True)
class Discard:
    """Make the coming `optimizer.step()` a no-op (the post-hook gives the gradients back)."""

    stats: StepStats
    """The step whose update is discarded (marked `skipped`)."""


@dataclass(frozen=True)
class Stop:
    """Close the run and raise `NanguardError` with the report."""

    stats: StepStats
    """The step it stops at."""
    why: str
    """One line: why it stopped (the error's message)."""


@dataclass(frozen=True)
class Record:
    """Record an action (report.json `actions`, run.db, an `action` event)."""

    step: int
    """The step it belongs to."""
    action: str
    """skip, rollback, clip, amp_skip, give_up, raise, none, ..."""
    detail: str
    """One line a person can read."""


@dataclass(frozen=True)
class FollowPeers:
    """After a rollback: the other rolling-back guards of the model roll back too (each
    records its own action), after this guard recorded its own."""

    step: int
    """The training step of the rollback."""
    optimizer: str
    """The optimizer that rolled back (its class name), for the peers' action text."""
    factor: float
    """Its LR backoff factor, applied by the peers as well."""


Effect: TypeAlias = Discard | Stop | Record | Alarm | FollowPeers
"""One effect; an `Alarm` is recorded as an alarm raised outside the detectors."""
