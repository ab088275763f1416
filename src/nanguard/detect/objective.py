"""Is the loss a stationary series? On-policy RL and GANs say no, and loss trends mean nothing.

A supervised run's loss is one function of a fixed data distribution: a loss that climbs far
above its recent level, or one batch's loss far above it, is news. In on-policy RL every
iteration collects a new rollout with the current policy and the value loss grows with the
returns; in a GAN each network's loss is set by the other one's progress. There the loss rises
and falls without anything going wrong, and the loss-trend detectors (divergence, the spike
detector's loss test) would cry wolf on a healthy run. The gradient, non-finite, cascade and
forecast detectors keep watching: a NaN or an exploding gradient is news in any objective.

How the guard knows, without a setting (`DetectConfig.objective` = `auto`):

- **A rollout buffer in the batches** (`Rollouts`): on-policy RL updates on the rows of one
  rollout for a few epochs (the same rows, reshuffled), then on a new rollout's rows, never
  seen before. A batch of fresh rows right after batches of reused rows is a rollout renewed;
  a supervised loader never does that (an epoch loop reuses rows from its second epoch on and
  brings none new; a random-crop loader never reuses any). Read from the samples' fingerprints
  the guard takes anyway, on the first `Rollouts.steps` steps only.
- **An RL environment library** loaded in the process (gymnasium, gym, stable-baselines3, ...).
- **Another guard stepping on another model** in the process, its steps between this one's
  (a GAN's generator and discriminator, an actor and a critic with optimizers of their own):
  coupled objectives. A guard left open by an earlier experiment, no longer stepping, is not.

`DetectConfig.objective` = `stationary` / `nonstationary` settles it for a program that shows
none of these. The decision is one action in the report (`loss_trend_off`, with its evidence).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any

from nanguard.watch.stats import HASHES_SLOT, combined_hashes

RL_LIBRARIES = ("gymnasium", "gym", "stable_baselines3", "pettingzoo", "dm_env", "envpool",
                "brax", "procgen", "minigrid", "torchrl", "tianshou", "sample_factory",
                "rl_games", "skrl")
"""Top-level modules whose presence means reinforcement learning (checked in `sys.modules`)."""

_FRESH = 0.1
"""A batch with at most this share of rows seen before is fresh..."""
_REUSED = 0.9
"""...and one with at least this share is reused."""

_STEPPING: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
"""Open watches by the id of the model their guard trains (a GAN's two guards: two models)."""

_TICKS = itertools.count(1)
"""Steps observed by every watch of the process, in order: a peer counts only when it stepped
between two steps of this guard (a guard left open by an earlier experiment does not)."""


class Rollouts:
    """Watches the batches' sample fingerprints for a rollout renewed (module docstring).

    Args:
        steps: how many steps to watch (a PPO iteration of 4 epochs x 32 minibatches is 128).
        max_rows: fingerprints kept at most (memory bound); the watch ends when full.
    """

    def __init__(self, steps: int = 600, max_rows: int = 200_000) -> None:
        self.steps = steps
        self.max_rows = max_rows
        self.seen: set[int] = set()
        self.reused_at: int | None = None  # the last step whose batch was reused rows
        self.pending: list[tuple[int, Any]] = []  # (step, fingerprints as kept), not yet read

    def keep(self, step: int, kept: Any) -> None:
        """One step's fingerprints as the step holds them (`watch.stats.HASHES_SLOT`): no
        read now, `settle` reads them when a decision is needed."""
        self.pending.append((step, kept))

    def settle(self) -> str | None:
        """Read the kept steps in order; the evidence when a rollout was renewed among them."""
        pending, self.pending = self.pending, []
        for step, kept in pending:
            why = self.observe(step, combined_hashes(kept))
            if why is not None:
                return why
        return None

    def observe(self, step: int, hashes: list[int]) -> str | None:
        """Take one step's fingerprints; the evidence when a rollout was renewed, else None."""
        if not hashes:
            return None
        old = sum(h in self.seen for h in hashes) / len(hashes)
        self.seen.update(hashes)
        if old >= _REUSED:
            self.reused_at = step
        elif old <= _FRESH and self.reused_at is not None and self.reused_at >= step - 2:
            return (f"the batches reuse their rows for a few steps, then take new ones (step "
                    f"{self.reused_at}: all seen before; step {step}: {old:.0%} seen before): "
                    "a rollout buffer refilled, on-policy RL")
        return None

    def done(self, step: int) -> bool:
        return step >= self.steps or len(self.seen) >= self.max_rows


class Objective:
    """Per guard: decides whether its loss is a stationary series and, when not, turns the
    loss-trend tests of its detectors off (their `nonstationary` flag).

    Runs at the start of the detectors' pre-update pass (`observe`) while `watching`; a quiet
    step costs an attribute read once the decision is made (or the watch is over).

    Args:
        setting: `DetectConfig.objective` (`auto`, `stationary`, `nonstationary`).
        detectors: the guard's detectors (those with a `nonstationary` attribute are told).
        model: the model the guard trains (for the peers' test).
    """

    def __init__(self, setting: str, detectors: list[Any], model: Any) -> None:
        self.detectors = [d for d in detectors if hasattr(d, "nonstationary")]
        self.model_id = id(model)
        self.why: str | None = None
        self.rollouts = Rollouts()
        self.tick = self.prev_tick = 0  # `_TICKS` at this guard's latest step, the one before
        self.watching = setting == "auto"
        if setting == "nonstationary":
            self._set("DetectConfig.objective is 'nonstationary'")
        if self.watching:
            _STEPPING[self] = self.model_id

    def observe(self, stats: Any) -> str | None:
        """One step (pre-update, its values read): its tick and its fingerprints as they are
        kept (no read). Decides only when the watch ends; the evidence when the objective was
        then found non-stationary (the caller records it), else None."""
        self.prev_tick, self.tick = self.tick, next(_TICKS)
        step = stats.step
        # The fingerprints as the step holds them: no read, no call (a quiet step's cost).
        self.rollouts.pending.append((step, stats.__dict__.get(HASHES_SLOT, [])))
        if step < self.rollouts.steps:
            return None
        why = self.settle()
        if why is None:
            self.watching = False
            _STEPPING.pop(self, None)
        return why

    def settle(self) -> str | None:
        """Decide now (a loss-trend alarm is about to be raised while the objective is
        undecided, or the watch ends): an RL library loaded, a peer guard stepping between
        this one's steps, or the fingerprints kept so far showing a rollout renewed. The
        evidence when the objective is non-stationary (the caller drops the loss-trend alarms
        and records it), else None. Deciding only when it matters keeps the quiet step free of
        reads and the report free of a decision that changed nothing."""
        if not self.watching:
            return None
        why = self._library()
        if why is None and len(_STEPPING) > 1:
            why = self._peer()
        if why is None:
            why = self.rollouts.settle()
        if why is not None:
            self._set(why)
        return why

    def close(self) -> None:
        self.watching = False
        self.rollouts.pending = []
        _STEPPING.pop(self, None)

    def _set(self, why: str) -> None:
        self.why = why
        self.watching = False  # (still a peer of the others until it closes: they may ask)
        for d in self.detectors:
            d.nonstationary = True

    @staticmethod
    def _library() -> str | None:
        found = [m for m in RL_LIBRARIES if m in sys.modules]
        return f"{found[0]} is loaded: reinforcement learning" if found else None

    def _peer(self) -> str | None:
        if not self.prev_tick:
            return None  # this guard's first step: nothing stepped "between" yet
        lo, hi = self.prev_tick, self.tick
        others = {m for w, m in list(_STEPPING.items())
                  if w is not self and m != self.model_id and lo < w.tick < hi}
        if not others:
            return None
        return ("another guard trains another model in this process (a GAN's generator and "
                "discriminator, an actor and a critic): each loss moves with the other")


def loss_trend(alarm: Any) -> bool:
    """Whether an alarm is one of the loss-trend tests a non-stationary objective turns off."""
    return alarm.kind == "divergence" or (alarm.kind == "spike" and alarm.signal == "loss")


def message(why: str) -> str:
    """The `loss_trend_off` action's detail."""
    return (f"the loss is not a stationary series here ({why}): its trend alarms (divergence, "
            "loss spikes) are off; gradient, non-finite, cascade and forecast alarms keep "
            "watching (DetectConfig.objective='stationary' keeps them on)")
