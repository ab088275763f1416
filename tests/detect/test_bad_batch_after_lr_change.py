"""A loss spike right after an LR jump is not blamed on its batch.

Seen on nanoGPT (BENCHMARKS.md "Held-out spikes on nanoGPT"): the schedule jumps 10x at
iteration 400; iteration 401's loss, computed with the parameters the first update at the new
LR made, spiked, and the spike detector named its clean batch a bad batch (the LR of 401 equals
the LR of 400, so "LR unchanged"), and `skip` discarded its update. The LR that matters for a
step's loss is the one of the update before it. Driven through the quiet gate, as the guard
drives the detectors (the LRs of the steps before are kept by both paths).
"""

from __future__ import annotations

from nanguard.config import DetectConfig
from nanguard.detect import default_detectors
from nanguard.detect.bad_batch import BAD_BATCH
from nanguard.detect.gate import QuietGate
from nanguard.watch.stats import StepStats

JUMP = 200


def _alarms_at_spike(lrs: dict[int, float]) -> list:
    """200 quiet steps at LR 0.01 (the loss falling slowly, a little noise), LRs changed
    where `lrs` says, and a loss 5x its level at step JUMP + 1 with an ordinary gradient."""
    detectors = default_detectors(DetectConfig())
    gate = QuietGate(detectors)
    found = []
    for step in range(JUMP + 2):
        noise = 0.02 * ((step * 7) % 5 - 2)
        loss = (5.0 if step == JUMP + 1 else 1.0 - 0.0005 * step + noise)
        stats = StepStats(step=step, lr=lrs.get(step, 0.01), loss=loss,
                          grad_norms={0: 1.0 + noise}, param_norms={0: 10.0})
        alarms = gate.run(stats, "both", stats.seal())
        if step == JUMP + 1:
            found = alarms
    return found


def test_a_spike_after_the_first_update_at_a_new_lr_is_not_a_bad_batch() -> None:
    alarms = _alarms_at_spike({JUMP: 0.1, JUMP + 1: 0.1})
    assert any(a.kind == "spike" and a.signal == "loss" for a in alarms), alarms
    assert not [a for a in alarms if a.cause == BAD_BATCH]


def test_the_same_spike_with_the_lr_steady_is_a_bad_batch() -> None:
    alarms = _alarms_at_spike({})
    assert [a.cause for a in alarms if a.signal == "loss"] == [BAD_BATCH]


def test_the_lr_two_steps_back_survives_a_state_dict_round_trip() -> None:
    a, b = (default_detectors(DetectConfig()) for _ in range(2))
    spike_a = next(d for d in a if type(d).__name__ == "SpikeDetector")
    spike_b = next(d for d in b if type(d).__name__ == "SpikeDetector")
    for step, lr in enumerate((0.01, 0.1)):
        stats = StepStats(step=step, lr=lr, loss=1.0, grad_norms={0: 1.0}, param_norms={0: 1.0})
        spike_a.check(stats)
    spike_b.load_state_dict(spike_a.state_dict())
    assert (spike_b.prev_lr, spike_b.last_lr) == (0.01, 0.1)
