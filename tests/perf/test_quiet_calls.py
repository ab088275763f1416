"""Python calls nanguard makes per quiet step of the default guard, counted with cProfile.

The guard is driven through its public entry points only (`watch`, `optimizer.step()`), on
nn.Linear(20, 1) past the detectors' warm-up; the count can only go down (issue 39's target
is <= 30; BENCHMARKS.md says where the calls are). The same guard with the quiet gate off
(`DetectConfig(quiet_gate=False)`) shows what the gate saves, and the gate must take every
quiet step (counted by wrapping `QuietGate.passes` from here, outside the profile).
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

# The number reached (59.3 measured with the step pipeline of issue 39, 61.2 before), with a
# little room for Python-version differences in how comprehensions count.
MAX_CALLS_PER_STEP = 61
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
