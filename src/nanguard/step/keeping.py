"""Keeping a judged step: what a step leaves behind once its detectors have run.

`keep` runs once per step read, after the detectors (`step.judging`), on every path: the loss
level, the grad-norm baseline, the history up to the first non-finite value, run.db's row, the
open alarm episode's tick and the step listeners. Nothing in it decides or acts.
"""

from __future__ import annotations

from nanguard.config import GuardConfig
from nanguard.pinpoint.baseline import GradBaseline
from nanguard.record.rows import step_signals, write_step
from nanguard.step.build import Parts
from nanguard.step.state import StepState
from nanguard.watch.stats import StepStats

__all__ = ["keep"]


def keep(config: GuardConfig, state: StepState, parts: Parts, stats: StepStats,
         signals: list[str] | None = None) -> None:
    """Keep the judged step `stats` (see the module docstring); `state` and `parts` are the
    pipeline's, `signals` the step's non-finite signals as the detectors sealed them (None:
    `stats.seal()` says: a step stopped before its detectors were done)."""
    state.last_stats = stats
    log = parts.log
    finding = log.finding
    state.losses.observe(stats.loss, stats.skipped,
                         troubled=finding is not None or log.recovered_from)
    if state.loss_after is not None:
        _check_loss_after(state, parts, stats)
    if signals is None:
        signals = stats.seal()
    if not stats.alarms and not signals:
        # Each parameter's typical grad norm on healthy steps: the baseline of a spike,
        # folded in when read (`pinpoint.baseline`).
        pending = state.grad_baseline.pending
        pending.append(stats.grad_norms)
        if len(pending) >= GradBaseline.FOLD_AT:
            state.grad_baseline.fold()
    # Keep the steps up to the first non-finite value: what led into it is the story.
    if finding is None or stats.step <= finding.step + 1:
        log.history.append(stats)
    write_step(parts.store, stats, len(state.params), config.watch.per_parameter, signals)
    events = parts.events
    if events.episodes.start is not None:  # an episode is open (a quiet step: nothing)
        events.tick(stats.step, bool(signals))
    if events.step_listeners:
        events.step(stats.step, step_signals(stats))


def _check_loss_after(state: StepState, parts: Parts, stats: StepStats) -> None:
    """One of the first steps after a resume or an LR jump: its loss against the loss
    before (`recover.loss_after`); one alarm at most."""
    check = state.loss_after
    assert check is not None
    alarm = check.see(stats.step, stats.loss, parts.recovery.lr_changes.jump)
    if alarm is not None or check.done(stats.step + 1):
        state.loss_after = None
    if alarm is not None:  # recorded, not a detector's: the step is judged as before
        parts.log.add_alarm(alarm)
