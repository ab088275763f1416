"""A bad batch is named after quiet steps, not after one quiet step inside a run of spikes
(`detect.bad_batch.QUIET_STEPS`). nanoGPT resumed at 20x (seed 0, BENCHMARKS.md "skip acts for
the cause"): the loss sat 1.5-1.8x its level for 400 iterations, 795's dipped under the spike
threshold, and 796 (a spike 2 steps after 794's) was named a bad batch and skipped."""

from __future__ import annotations

from nanguard.detect.bad_batch import QUIET_STEPS, LossOutlier, judge


def _judge(last_spike: int | None) -> str | None:
    return judge(796, LossOutlier(1.56, 0.97, 14.0), lr=0.06, last_lr=0.06, prev_lr=0.06,
                 last_spike=last_spike, before_jump=1.0)


def test_a_spike_two_steps_after_another_is_not_its_batch() -> None:
    assert _judge(794) is None
    assert _judge(796 - QUIET_STEPS) is None


def test_a_spike_after_quiet_steps_is_its_batch() -> None:
    for last in (None, 796 - QUIET_STEPS - 1, 300):
        cause = _judge(last)
        assert cause is not None and cause.startswith("a bad batch: its own loss 1.56"), last
