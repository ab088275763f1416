"""Python calls nanguard makes per quiet step of the default guard, counted with cProfile.

Issue 26 asks for <= 25. Not reached: ~58 on this commit (was ~176, then 146 with the quiet
gate, 112 with C-level `map`s in the hot checks, 90 with the post-update layout built once per
signature, 70 with the quiet lane: `watch/lane.py` measures and reads a step without packets
or pending-step objects; 58 with a small CPU batch measured on the host and nothing of it in the
read, the grad baseline folded lazily (`pinpoint/baseline.py`), the three global norms kept by
`seal` and asked in one call (`StepStats.global_norms`), the lane's pre-update parts made with
its step, and calls split only by habit fused). What remains on nn.Linear(20, 1), by count:
the guard's hooks and step path ~14 (`step_path.py`: the two hooks, `_pre`, `_lane_post`,
`_detect`, `_record`, `_sync_params`, `_lr`, `_next_rng`, `_watch`), the lane's measuring and
decoding ~17 (`watch/stats.py`: gradient and post-update norms, decoding, the seal and the
non-finite scan; `lane.py`, `norms.py`, `layout.py`, `packet.host_values`, `step.read`), the
batch 7 (`batch.py`, `fingerprint.py`), the gate 3, recovery, saturation and RNG bookkeeping
~7, the record's row ~6. Each is a function boundary between modules that own their part
(detectors, record, recovery); below 25 needs them fused into one function per hook, which the
exactness tests would then have to cover line by line: not done. The calls are not where the
time goes either (~0.1 us each: ~6 us of the ~150 us the guard adds to this step; the rest is
tensor ops, cold in a training step, the gate's and the record's arithmetic). This test pins
the number reached so that it can only go down, and that the gate takes the quiet steps.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any

import pytest
import torch

import nanguard
from nanguard import DetectConfig, GuardConfig, RecordConfig
from nanguard.detect.gate import QuietGate

# The number reached (58.2 measured on this commit's default guard), with a little room for
# Python-version differences in how comprehensions count.
MAX_CALLS_PER_STEP = 62
# The same guard with the gate off: what the gate saves must stay saved.
MIN_SAVED_BY_GATE = 25


def _calls_per_step(tmp: Path, gate: bool, took: list[int]) -> tuple[float, int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = nanguard.Guard(model, opt, out=tmp, config=GuardConfig(
        record=RecordConfig(summary=False), detect=DetectConfig(quiet_gate=gate)))
    x, y = torch.randn(64, 20), torch.randn(64, 1)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        g.watch(loss=loss, batch=(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(50):  # past the detectors' warm-up
        step()
    passed = took[0]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step()
    prof.disable()
    g.close()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ours = sum(v[1] for k, v in stats.items() if "nanguard" in Path(k[0]).parts)
    return ours / 100, took[0] - passed


def test_quiet_step_call_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    took = [0]  # the steps the gate took: counted outside nanguard (not in the profile)
    passes = QuietGate.passes

    def counting(self: QuietGate, *args: Any) -> bool:
        passed = passes(self, *args)
        took[0] += passed
        return passed

    monkeypatch.setattr(QuietGate, "passes", counting)
    on, passed = _calls_per_step(tmp_path / "on", True, took)
    off, _ = _calls_per_step(tmp_path / "off", False, took)
    assert passed == 100  # every quiet step took the gate
    assert on <= MAX_CALLS_PER_STEP, f"{on} nanguard calls per quiet step"
    assert off - on >= MIN_SAVED_BY_GATE, (on, off)
