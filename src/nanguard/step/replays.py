"""Replays and re-runs of a step: where its first non-finite value showed, which samples and
layers carry a spike, whether it re-runs the same (on this rank, or on a peer's).

Called by the step pipeline on the steps that need them (an alarm, a non-finite value, a
GradScaler skip under a replay, a sampled re-run); never on a quiet step. The measuring is
`pinpoint`'s; this module hands it the step and records what it found in the run log.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanguard.detect import Alarm, bad_batch
from nanguard.pinpoint import live as pinpoint
from nanguard.pinpoint import xrank, xrank_log
from nanguard.runtime import distributed
from nanguard.step.build import Parts
from nanguard.step.state import StepState
from nanguard.watch.stats import StepStats
from nanguard.watch.step import Pending

__all__ = ["StepReplays"]


class StepReplays:
    """The replays of one guard's pipeline.

    Args:
        replay: the user's `replay(batch) -> loss`, or None (then only what needs no forward).
        model: the model trained.
        parts, state: the pipeline's (read when called: the state changes step by step).
    """

    def __init__(self, replay: Callable[[Any], torch.Tensor] | None, model: nn.Module,
                 parts: Parts, state: StepState) -> None:
        self._replay, self._model, self._parts, self._state = replay, model, parts, state

    def scaler_skip(self, stats: StepStats) -> None:
        """The GradScaler skipped the step before this one: with `replay`, was it an fp16
        overflow or a real fault it hid? (`pinpoint.live.scaler_skip_finding`)."""
        skipped, self._parts.batch_probe.skipped = self._parts.batch_probe.skipped, []
        if self._replay is None or self._parts.log.finding is not None:
            return
        found = pinpoint.scaler_skip_finding(
            stats, self._replay, model=self._model, params=self._state.params, skipped=skipped,
            act_probe=self._parts.act_probe, rank=distributed.rank())
        if found is not None:
            self._parts.log.set_finding(found, failing=stats, announce=True)

    def refine(self, stats: StepStats, cur: Pending) -> None:
        """Refine the first non-finite finding by replaying this step before its update."""
        assert self._replay is not None and self._parts.log.finding is not None
        update, news = pinpoint.refine_by_replay(
            self._parts.log.finding, stats, self._replay, model=self._model,
            params=self._state.params, batches=self._parts.batch_probe,
            act_probe=self._parts.act_probe, step_rng=cur.rng)
        if update:
            self._parts.log.refine_finding(update, write=news, announce=news)

    def cross_rerun(self, step: int, loss: float | None, alarms: list[Alarm],
                    own: dict[str, Any] | None) -> None:
        """Every rank, after an agreement that named `StepState.rerun_rank`: re-run that
        rank's batch there and on a peer, and record the verdict of `step` (`pinpoint.xrank`);
        `loss`, `own`: the step's loss and this rank's own re-run verdict (the suspect's
        count). A rank that cannot take part any more raises out of here (a timeout: a peer
        died) and stands down."""
        assert self._replay is not None and self._state.rerun_rank is not None
        cur = self._state.current
        verdict = xrank.cross_rerun(
            self._replay, suspect=self._state.rerun_rank, model=self._model,
            params=self._state.params, batch=self._parts.batch_probe.last,
            step_rng=cur.rng if cur is not None else None, loss=loss, own=own)
        xrank_log.record(self._parts.log, step, alarms, verdict)

    def locate(self, stats: StepStats) -> dict[str, Any]:
        """Where the step's first non-finite value showed (phase, tensors, samples)."""
        st = self._state
        return pinpoint.locate_step(stats, st.param_names, distributed.rank(),
                                    order=st.param_order, buffer_names=self._parts.buffer_names)

    def explain_spike(self, stats: StepStats, alarm: Alarm) -> None:
        """Which layers carry a spike and, seen before its update with `replay`, which samples
        cause it and whether it re-runs the same (`pinpoint.live.explain_spike`)."""
        cur = self._state.current
        before_update = cur is not None and cur.stats is stats
        found = pinpoint.explain_spike(
            stats, replay=self._replay if before_update else None, model=self._model,
            params=self._state.params, param_names=self._state.param_names,
            batches=self._parts.batch_probe,
            act_probe=self._parts.act_probe, baseline=self._state.grad_baseline.values(),
            step_rng=cur.rng if before_update and cur else None,
            amp=self._parts.recovery.amp is not None,
            loss_level=pinpoint.loss_level(self._parts.detectors))
        if alarm.kind != "spike":  # an overflow the spike detector could not see (step 0)
            found["alarm"] = alarm.kind
        elif (alarm.cause is None and alarm.signal == "grad_norm"
              and (note := pinpoint.row_suspect(self._parts.detectors, stats.step))
              and (cause := bad_batch.by_rows(found, note))):
            # the rows the replay just measured name the batch (no loss outlier needed):
            # before the policy decides, so skip and heal act on a bad batch
            alarm.cause = bad_batch.BAD_BATCH
            alarm.message += f"; {cause}"
        found.update(bad_batch.spike_entry(stats, alarm, found))
        self._parts.log.add_spike(stats.step, found)
        alarm.message += pinpoint.spike_note(found)

    def sampled_rerun(self, stats: StepStats) -> list[Alarm]:
        """`DetectConfig.rerun_every`: re-run this quiet step before its update and compare
        bit for bit; a `rerun_mismatch` alarm when it differs (its verdict is kept with the
        spikes' ones, where the diagnosis reads re-run verdicts)."""
        cur = self._state.current
        if self._replay is None or cur is None or cur.stats is not stats:
            return []  # no forward to re-run, or the step was read after its update
        found = pinpoint.rerun(stats, self._replay, model=self._model, params=self._state.params,
                               batches=self._parts.batch_probe, act_probe=self._parts.act_probe,
                               step_rng=cur.rng, amp=self._parts.recovery.amp is not None)
        if found.get("verdict") != "transient":
            return []
        self._parts.log.add_spike(stats.step, {"layers": [], "samples": [], "rerun": found,
                                               "alarm": "rerun_mismatch"})
        return [Alarm(step=stats.step, kind="rerun_mismatch", signal="rerun",
                      value=float(found.get("differing") or 0),
                      message=f"a sampled re-run of step {stats.step} differs from the step "
                      f"itself: {found.get('why')}")]
