"""Python calls nanguard makes per quiet step of the default guard, counted with cProfile.

Issue 26 asks for <= 25. Not reached: ~112 on this commit (was ~176). The quiet gate
(`detect/gate.py`) takes the detectors from ~33 calls a step to 3; generators in the hot
checks (norms' dtype check, the packet read, the batch's tensors, the overflow check) became
C-level `map`/loops (~32 more). The rest, on nn.Linear(20, 1): the watch path ~64
(`watch/stats.py` 37: decoding, the global norms asked by the gate and the record, the
non-finite scan; `packet.py` 16; `step.py` 6; `norms.py` 5), the batch fingerprints ~16
(`watch/batch.py`, `fingerprint.py`), the guard's hooks and step 14, recovery, saturation
and RNG bookkeeping ~10, the record's row ~5. Below 25 needs the layout per signature and the
decoding and row encoding on the writer thread (not done). This test pins the number reached
so that it can only go down, and that the gate takes the quiet steps.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import torch

import nanguard
from nanguard import GuardConfig, RecordConfig

# The number reached (112.2 measured on this commit's default guard), with a little room for
# Python-version differences in how comprehensions count.
MAX_CALLS_PER_STEP = 116
# The same guard with the gate off: what the gate saves must stay saved.
MIN_SAVED_BY_GATE = 25


def _calls_per_step(tmp: Path, gate: bool) -> tuple[float, int]:
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = nanguard.Guard(model, opt, out=tmp, config=GuardConfig(record=RecordConfig(summary=False)))
    g._gate.enabled = gate
    x, y = torch.randn(64, 20), torch.randn(64, 1)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        g.watch(loss=loss, batch=(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(50):  # past the detectors' warm-up
        step()
    passed = g._gate.passed
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        step()
    prof.disable()
    g.close()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    ours = sum(v[1] for k, v in stats.items() if "nanguard" in Path(k[0]).parts)
    return ours / 100, g._gate.passed - passed


def test_quiet_step_call_count(tmp_path: Path) -> None:
    on, passed = _calls_per_step(tmp_path / "on", True)
    off, _ = _calls_per_step(tmp_path / "off", False)
    assert passed == 100  # every quiet step took the gate
    assert on <= MAX_CALLS_PER_STEP, f"{on} nanguard calls per quiet step"
    assert off - on >= MIN_SAVED_BY_GATE, (on, off)
