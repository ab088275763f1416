"""Samples a rollback named, left out of training from then on.

A rollback that finds its culprit samples (a NaN or Inf row of the batch it rolled back, or the
samples per-sample attribution named for a spike of the episode) remembers their fingerprints;
a later batch holding one of them has its update discarded before it lands, so the sample
cannot start the trouble again (the next epoch). Only a guard that can roll back keeps one
(`Recovery.left_out`); it is empty, and costs a truth test per step, until a rollback fills it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nanguard.recover.effects import Discard, Effect, Record
from nanguard.watch.stats import StepStats

SPIKES_KEPT_STEPS = 1000
"""How far back the samples named for spikes are kept (steps)."""


class LeftOut:
    """The fingerprints a rollback named (module docstring).

    Args:
        spikes: where each spike sat so far (the guard's `spikes`: step, layers, samples).
    """

    def __init__(self, spikes: Callable[[], list[dict[str, Any]]]) -> None:
        self._spikes = spikes
        self.named: dict[int, int] = {}
        """Fingerprint of a sample left out -> the step of the rollback that named it."""
        self.updates = 0
        """Updates discarded because their batch held such a sample."""
        self._spike_samples: dict[int, list[int]] = {}  # step -> fingerprints attribution named

    def __bool__(self) -> bool:
        return bool(self.named)

    def check(self, stats: StepStats) -> list[Effect]:
        """Before an update: the discard and its record when the batch holds a sample left
        out; empty when the batch is clean."""
        hit = [h for h in stats.sample_hashes if h in self.named]
        if not hit:
            return []
        self.updates += 1
        return [Discard(stats), Record(
            stats.step, "skip",
            f"update discarded: the batch holds {len(hit)} sample(s) left out after the "
            f"rollback at step {self.named[hit[0]]} (fingerprint(s) "
            f"{', '.join(f'{h:#x}' for h in hit[:4])})")]

    def remember(self, stats: StepStats, since: int) -> list[int]:
        """After a rollback at `stats.step`: the fingerprints to leave out from now on, the
        batch's NaN / Inf rows and the samples attribution named for the spikes of the
        episode (steps `since`..now)."""
        hashes = stats.sample_hashes
        rows = [i for i in stats.nonfinite_samples if i < len(hashes)]
        found = [hashes[i] for i in rows]
        self.note_spikes(stats)
        found += [h for step, hs in self._spike_samples.items() if since <= step <= stats.step
                  for h in hs]
        for h in found:
            self.named.setdefault(h, stats.step)
        return found

    def note_spikes(self, stats: StepStats) -> None:
        """The fingerprints of the samples per-sample attribution named for a spike of this
        step, while the step's fingerprints are at hand (a later rollback may leave them out)."""
        if stats.step in self._spike_samples or not any(a.kind == "spike" for a in stats.alarms):
            return
        hashes = stats.sample_hashes
        named = [int(d["index"]) for sp in self._spikes() if sp.get("step") == stats.step
                 for d in sp.get("samples", [])]
        self._spike_samples[stats.step] = [hashes[i] for i in named if 0 <= i < len(hashes)]
        for old in [k for k in self._spike_samples if k < stats.step - SPIKES_KEPT_STEPS]:
            del self._spike_samples[old]

    def state_dict(self) -> dict[str, int]:
        return {str(h): s for h, s in self.named.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.named = {int(h): int(s) for h, s in state.items()}
