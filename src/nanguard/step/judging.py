"""Judging a step read: the detectors (behind the quiet gate), the first non-finite finding,
the record, and the policy's decisions, before the update and after it.

The step pipeline (`step.pipeline`) measures a step and reads it; it hands each step read
here: `before_update` when something must be decided before the update (an acting policy, a
replay armed, a cross-rank agreement), `after_update` for every step read after it. Both
judge a step the same way whichever reader read it (the quiet lane or the packet path).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanguard.config import GuardConfig
from nanguard.detect import Alarm, objective
from nanguard.pinpoint import xrank_log
from nanguard.pinpoint.rerun import alarms_to_explain
from nanguard.record.finding import Finding
from nanguard.runtime import distributed
from nanguard.step.acting import Acting
from nanguard.step.build import Parts
from nanguard.step.keeping import keep
from nanguard.step.replays import StepReplays
from nanguard.step.state import StepState
from nanguard.watch import rng
from nanguard.watch.lane import LaneStep
from nanguard.watch.stats import StepStats
from nanguard.watch.step import Pending

__all__ = ["Judge", "lr_of"]


def lr_of(optimizer: torch.optim.Optimizer) -> float | None:
    """The LR of the optimizer's first group, as a float (None: none, or not a number)."""
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


class Judge:
    """The judging part of one guard's pipeline.

    Args:
        config: the guard's settings.
        optimizer: the optimizer trained (the LR an update really uses is read from it).
        state, parts, replays: the pipeline's (read when called: the state changes each step).
        acting: the pipeline's `Acting`, which decides and applies effects.
    """

    def __init__(self, config: GuardConfig, optimizer: torch.optim.Optimizer, state: StepState,
                 parts: Parts, replays: StepReplays, acting: Acting) -> None:
        self._config, self._optimizer = config, optimizer
        self._state, self._parts, self._replays, self._acting = state, parts, replays, acting
        self._observing = config.policy == "observe"
        self._apply: Callable[[list[Any]], None] = acting.apply
        self._check_amp = parts.recovery_steps.check_amp  # None without a scaler: no call

    def before_update(self, stats: StepStats, cur: Pending | LaneStep, replaying: bool) -> None:
        """The pre-update part of a step read before its update (`stats`, of `cur`), called by
        the pre-hook: detect, pinpoint with a replay, decide and act (acting policies),
        recovery's own step."""
        parts, acting = self._parts, self._acting
        alarms, signals = self.detect(stats, "pre", cur.rng)
        if replaying and parts.log.finding is not None:
            assert isinstance(cur, Pending)  # the lane takes no step with a replay armed
            self._replays.refine(stats, cur)
        elif replaying and stats.amp_skipped:
            self._replays.scaler_skip(stats)
        if (not self._observing or parts.cross_rank) and (
                alarms or signals or replaying or distributed.active()):
            # (A quiet step of one process leaves the policy nothing to decide: no call.)
            want, own = (xrank_log.request(parts.log, stats.step)
                         if parts.cross_rank else (0, None))
            act = acting.decide(stats, alarms, want=want)
            if self._state.rerun_rank is not None:
                self._replays.cross_rerun(stats.step, stats.loss, stats.alarms, own)
            if act:
                acting.act(stats, alarms)
        if not stats.skipped:
            self._state.skips_in_row = 0
            effects = parts.recovery.before_update(stats)
            if effects:  # a quiet step applies nothing (no call)
                self._apply(effects)
            stats.lr = lr_of(self._optimizer)  # the LR this update really uses (after backoff)

    def after_update(self, p: Pending | LaneStep, stats: StepStats, fresh: bool) -> None:
        """Everything after the update for one step read (`stats` of `p`; `fresh`: its
        pre-update part was not judged before the update): the detectors of both phases in
        one pass under `observe` (nothing acts between them), else the post-update ones; the
        record (`step.keeping`); the policy's post-update decision (recorded first: `raise`
        and a rollback give-up stop inside `act`)."""
        if p.device_skip:
            self._acting.device_skipped(p, stats)
        observing = self._observing
        if fresh and observing:
            alarms, signals = self.detect(stats, "both", p.rng)
        else:
            if fresh:
                self.detect(stats, "pre", p.rng)
            alarms, signals = self.detect(stats, "post", p.rng)
        keep(self._config, self._state, self._parts, stats, signals)
        if not observing and (alarms or signals or distributed.active()) and self._acting.decide(
                stats, alarms, post=True):
            self._acting.act(stats, alarms, post=True)

    def detect(self, stats: StepStats, phase: str, step_rng: dict[str, Any] | None = None
               ) -> tuple[list[Alarm], list[str]]:
        """Run the detectors of `phase` (`pre`, `post`, or `both`: pre then post, for a step
        read after its update where nothing acts between the two) on `stats`; record their
        alarms in the run log and on the step. Returns the alarms and the step's non-finite
        signals as sealed for the detectors (what the record keeps)."""
        parts = self._parts
        alarms: list[Alarm] = []
        if phase != "post" and self._check_amp is not None:
            effects, alarms = self._check_amp(stats)
            if effects:
                self._apply(effects)
            if stats.amp_skipped and stats.activations:
                # The activations include the forward of a step the GradScaler skipped on an
                # expected fp16 overflow: its inf/NaN are not this step's (nor an alarm).
                stats.activations = {m: v for m, v in stats.activations.items()
                                     if math.isfinite(v)}
                stats.unseal()
        signals = stats.seal()  # final for this phase (decoding unseals): scan once
        if (parts.objective.watching and phase != "post"
                and (why := parts.objective.observe(stats)) is not None):
            parts.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        found = parts.gate.run(stats, phase, signals)  # each detector: quiet update or check
        if found:
            alarms += found
            if parts.objective.watching and any(map(objective.loss_trend, alarms)):
                alarms = self._settle_objective(stats, alarms)
        if alarms:
            for a in alarms_to_explain(alarms):  # spikes; an overflow at step 0
                self._replays.explain_spike(stats, a)
        elif phase != "post" and (every := self._config.detect.rerun_every) and (
                stats.step % every == 0):
            alarms += self._replays.sampled_rerun(stats)
        if signals:
            log = parts.log
            if log.finding is None:
                # run.db: with the step
                log.finding = Finding.from_dict(self._replays.locate(stats))
            if log.failing is None:
                log.failing = stats
        if alarms:
            if step_rng is not None:
                # Keep the RNG state at the start of an alarmed step: a replay needs it.
                parts.store.write_rng(stats.step, rng.dumps(step_rng))
            stats.alarms += alarms
            parts.log.add_alarms(alarms)
        return alarms, signals

    def _settle_objective(self, stats: StepStats, alarms: list[Alarm]) -> list[Alarm]:
        """A loss-trend alarm while the objective is undecided: read the fingerprints kept so
        far; if they show a rollout renewed, the loss-trend alarms are off from here (this
        step's dropped, said as the `loss_trend_off` action)."""
        why = self._parts.objective.settle()
        if why is None:
            return alarms
        self._parts.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        return [a for a in alarms if not objective.loss_trend(a)]
