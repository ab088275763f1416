"""Acting on a judged step: the cross-rank agreement, the policy's decision and its effects.

The step pipeline's judge (`step.judging`) asks `decide` whether this step is acted on (under
torch.distributed every rank answers the same), `act` for the policy's effects, and every
part that decides something (recovery, a GradScaler's stall, a fused optimizer's `found_inf`)
hands its effects to `apply`, which carries them out in order. Nothing here runs on a quiet
step under `observe`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanguard.config import GuardConfig
from nanguard.detect import Alarm
from nanguard.errors import NanguardError
from nanguard.policy import wants_to_act
from nanguard.policy.act import device_skip_effects, effects_of, keeps_update
from nanguard.record.report import Report
from nanguard.recover.effects import Discard, Effect, FollowPeers, Record, Stop
from nanguard.runtime import distributed
from nanguard.step.build import Parts
from nanguard.step.keeping import keep
from nanguard.step.replays import StepReplays
from nanguard.step.state import StepState
from nanguard.watch.lane import LaneStep
from nanguard.watch.stats import StepStats
from nanguard.watch.step import Pending

__all__ = ["Acting", "agree_device"]


def agree_device(state: StepState) -> torch.device:
    """Where a cross-rank agreement's tensor lives: the first parameter's device."""
    return state.params[0].device if state.params else torch.device("cpu")


class Acting:
    """The acting part of one guard's pipeline.

    Args:
        config: the guard's settings.
        state, parts, replays: the pipeline's (read when called: the state changes each step).
        stop: closes the run (the Guard's `close`); `Stop` calls it, then raises.
    """

    def __init__(self, config: GuardConfig, state: StepState, parts: Parts,
                 replays: StepReplays, stop: Callable[[str, str], Report]) -> None:
        self._config, self._state, self._parts, self._replays = config, state, parts, replays
        self._stop_run = stop
        self._overruled = False
        """This rank's policy keeps this step's update, another rank's discards it (`decide`)."""

    def decide(self, stats: StepStats, alarms: list[Alarm], post: bool = False,
               want: int = 0) -> bool:
        """This rank's verdict, agreed with every other rank under torch.distributed: all ranks
        act in the same step, or none does (one small int32 all-reduce). `want`: this rank
        asks for a cross-rank re-run (`pinpoint.xrank`; the agreed rank, if any, is left in
        `StepState.rerun_rank`). Under `observe` nothing acts. Raises `PeerStoodDown` when
        another rank's guard stood down (this one then does too)."""
        st, cfg = self._state, self._config
        st.rerun_rank = None
        self._overruled = False
        act = cfg.policy != "observe" and wants_to_act(stats, alarms, cfg.acting_on, post)
        if not distributed.active():
            return act
        # Whether this rank's policy would let the update go ahead (a recurring instability's
        # spike, `policy.recurrence`) is part of its verdict: one rank discarding it outweighs.
        hold = act and not post and keeps_update(
            self._parts.policy.verdict(stats, alarms, skips_in_row=st.skips_in_row),
            stats.step, self._parts.recovery)
        phase = self._replays.locate(stats)["phase"] or "" if stats.nonfinite_signals() else None
        agreed = distributed.agree(act, phase, agree_device(st), want=want, hold=hold)
        st.rerun_rank = agreed.rerun_rank
        st.agreed = True
        if agreed.bad_rank is not None:
            stats.agreed_bad_rank = agreed.bad_rank
        self._overruled = hold and not agreed.keep
        # Every acting rank keeps the update: a rank with no verdict of its own does nothing.
        return agreed.act and (act or not agreed.keep)

    def act(self, stats: StepStats, alarms: list[Alarm], post: bool = False) -> None:
        """Apply what the policy stage decides for this step (see `nanguard.policy`)."""
        st = self._state
        policy = self._parts.policy
        d = policy.decide(stats, alarms, post=post, skips_in_row=st.skips_in_row)
        if self._overruled and not post:
            # Another rank discards this update (its own batch traced, or a lone spike there):
            # every rank discards it, or the replicas would drift apart.
            d = policy.overruled(d, stats, alarms, skips_in_row=st.skips_in_row)
        effects, st.skips_in_row = effects_of(
            d, stats, recovery=self._parts.recovery, post=post, skips_in_row=st.skips_in_row,
            limit=self._config.recover.max_consecutive_skips)
        self.apply(effects)

    def device_skipped(self, p: Pending | LaneStep, stats: StepStats) -> None:
        """Record what the fused optimizer did with the `found_inf` flag of step `p` (read a
        step late on a GPU): a discarded update is a `skip` action; too many in a row stop the
        run, as the host-side `skip` does."""
        st = self._state
        if not p.found_inf:
            st.skips_in_row = 0
            return
        effects, st.skips_in_row = device_skip_effects(
            stats, skips_in_row=st.skips_in_row,
            limit=self._config.recover.max_consecutive_skips)
        self._parts.recovery.discarded(stats, late=stats.step != st.step - 1)
        self.apply(effects)

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`recover.effects`): record an
        action or an alarm, discard the coming update, let coupled guards follow a rollback,
        or stop (closes the run and raises `NanguardError`; nothing after it is applied)."""
        parts = self._parts
        for e in effects:
            if isinstance(e, Record):
                parts.log.add_action(e.step, e.action, e.detail)
            elif isinstance(e, Alarm):
                parts.log.add_alarm(e)
            elif isinstance(e, Discard):
                self._discard_update(e.stats)
            elif isinstance(e, FollowPeers):
                parts.recovery.follow_peers(e.step, e.optimizer, e.factor)
            elif isinstance(e, Stop):
                self._stop(e.stats, e.why)

    def give_back_grads(self) -> None:
        """`skip` took the gradients away for the update: give the user them back (the
        post-hook, or a stand-down with a skip in flight)."""
        st = self._state
        assert st.stashed_grads is not None
        for p, g in zip(st.params, st.stashed_grads, strict=True):
            p.grad = g
        st.stashed_grads = None

    def _discard_update(self, stats: StepStats) -> None:
        """Make the coming `optimizer.step()` a no-op: optimizers leave a parameter whose .grad
        is None untouched (no update, no state change, no step-counter increment). The
        post-hook puts the gradients back."""
        st = self._state
        if st.stashed_grads is None:
            st.stashed_grads = [p.grad for p in st.params]
            for p in st.params:
                p.grad = None
        stats.skipped = True
        self._parts.recovery.discarded(stats, late=False)

    def _stop(self, stats: StepStats, why: str) -> None:
        """Close the run and raise NanguardError with the report (the `raise` policy's end);
        a step stopped before its update is recorded first."""
        st = self._state
        if st.current is not None:
            keep(self._config, st, self._parts, stats)
            st.current = None
        message = f"nanguard stopped training at step {stats.step}: {why}"
        report = self._stop_run("stopped", message)
        raise NanguardError(message, report)
