"""Python calls nanguard makes per quiet step of the default guard, counted with cProfile.

Issue 26 asks for <= 25. Not reached: ~90 on this commit (was ~176, then 146 with the quiet
gate, 112 with C-level `map`s in the hot checks). The post-update layout is now built once per
signature (`watch/layout.py`: parameters, moments and buffers measured in one pass, decoded by
precomputed slices); the global norms are asked inline once sealed; the record's row, the
overflow checks and the packet read no longer make a call per group, packet or alarm-free
step. What remains on nn.Linear(20, 1): the watch path ~50 (`watch/stats.py` ~21: decoding,
the sealed globals, the non-finite scan; `packet.py` ~13; `step.py` 5; `norms.py` ~3;
`layout.py` 3), the batch fingerprints ~16 (`watch/batch.py`, `fingerprint.py`), the guard's
hooks and step ~14, the gate 3, recovery, saturation and RNG bookkeeping ~9, the record's row
~3. Below 25 needs the per-step objects (StepStats, two Packets, Pending) replaced by
preallocated arrays and the decoding moved to the writer thread (not done). This test pins the
number reached so that it can only go down, and that the gate takes the quiet steps.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path

import torch

import nanguard
from nanguard import GuardConfig, RecordConfig

# The number reached (90.1 measured on this commit's default guard), with a little room for
# Python-version differences in how comprehensions count.
MAX_CALLS_PER_STEP = 94
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
