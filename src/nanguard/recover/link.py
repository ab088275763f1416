"""The guard as recovery sees it: `GuardLink`, the whole interface recovery uses, and
`WeakLink`, that interface over a weak reference.

Recovery never keeps a dropped guard alive and never imports the Guard: it gets this link,
built from the guard duck-typed (anything with the attributes of `Guarded`).
"""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from torch import nn

from nanguard.config import GuardConfig
from nanguard.recover.effects import Effect


class GuardLink(Protocol):
    """The whole interface recovery uses from its guard."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer

    @property
    def step(self) -> int:
        """Optimizer steps completed (the index of the step in progress)."""
        ...

    @property
    def active(self) -> bool:
        """The guard is still watching (not closed, not stood down)."""
        ...

    def spikes(self) -> list[dict[str, Any]]:
        """Where each spike sat (the guard's `spikes`: step, layers, samples)."""
        ...

    def apply(self, effects: list[Effect]) -> None:
        """Apply effects to the guard, as its own step would (a coupled guard's rollback
        makes this one follow)."""
        ...


class Guarded(Protocol):
    """What the link reads of the guard it is built from."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    error: dict[str, Any] | None

    @property
    def step(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def spikes(self) -> list[dict[str, Any]]: ...

    def apply(self, effects: list[Effect]) -> None: ...


class WeakLink:
    """Recovery's link to `guard`: the settings, model and optimizer, the step counter,
    whether the guard still watches, its spikes, and `apply` for the effects a coupled guard's
    rollback has on this one (recovery returns its own step's effects to the guard instead)."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, guard: Guarded) -> None:
        self._guard = weakref.proxy(guard)
        self.config = guard.config
        self.model = guard.model
        self.optimizer = guard.optimizer

    @property
    def step(self) -> int:
        """Optimizer steps the guard completed."""
        return int(self._guard.step)

    @property
    def active(self) -> bool:
        """The guard is alive, not closed and has not stood down."""
        try:
            return not self._guard.closed and self._guard.error is None
        except ReferenceError:
            return False

    def apply(self, effects: list[Effect]) -> None:
        """Apply `effects` to the guard (`Guard.apply`)."""
        self._guard.apply(effects)

    def spikes(self) -> list[dict[str, Any]]:
        """Where each spike sat (a copy of the guard's `spikes`)."""
        return list(self._guard.spikes)
