"""The quiet lane's ways off its inline common case give what the packet path gives.

`watch.lane` writes the common CPU step inline (every parameter with a gradient, float32
norms by `_foreach_norm`, a small batch measured on the host) and hands anything else to the
probes' own methods: a parameter without a gradient, float64 and bfloat16 models, a CPU batch
too large to measure on the host (its fingerprints and row sums are read with the step). Each
case trains the same model twice from the same seed, the lane on and off
(`WatchConfig(quiet_lane=False)`: every step through `StepWatch`'s packets), with a NaN and an
Inf in the data at one step, and compares every recorded step field by field, the rows named
non-finite (found independently, from the batch itself) and the weights bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig, WatchConfig
from nanguard.watch.lane import QuietLane

BAD_STEP = 9


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _run(out: Path, lane: bool, rows: int, frozen: bool, dtype: torch.dtype
         ) -> tuple[list[str], list[torch.Tensor], list[int], list[int]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dtype)
    if frozen:  # in the optimizer, never given a gradient
        model[0].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    guard = nanguard.Guard(model, opt, out=out, config=GuardConfig(
        record=RecordConfig(summary=False), watch=WatchConfig(quiet_lane=lane)))
    gen = torch.Generator().manual_seed(1)
    bad: list[int] = []
    for i in range(BAD_STEP + 4):
        x = torch.randn(rows, 8, generator=gen, dtype=dtype)
        y = torch.randn(rows, 1, generator=gen, dtype=dtype)
        if i == BAD_STEP:
            x[5, 3], x[rows - 1, 0] = float("nan"), float("inf")
            bad = torch.nonzero(~torch.isfinite(x).all(dim=1)).flatten().tolist()
        loss = nn.functional.mse_loss(model(x).nan_to_num(), y)  # training goes on
        guard.watch(loss=loss, batch=(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()
    history = list(guard.history)
    guard.close()
    named = next(s.nonfinite_samples for s in history if s.step == BAD_STEP)
    return [repr(s) for s in history], [_bits(p) for p in model.parameters()], named, bad


@pytest.mark.parametrize(("rows", "frozen", "dtype"), [
    (300, False, torch.float32),  # a CPU batch above the host-measured size
    (32, True, torch.float32),    # a parameter without a gradient
    (32, False, torch.float64),   # norms in float64, not `_foreach_norm`'s float32
    (32, True, torch.bfloat16),   # float32 norms of bfloat16 tensors
])
def test_lane_fallbacks_match_the_packet_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              rows: int, frozen: bool, dtype: torch.dtype
                                              ) -> None:
    begin, lane_steps = QuietLane.begin, []

    def counting(lane: QuietLane, step: int, *args: object) -> object:
        lane_steps.append(step)
        return begin(lane, step, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(QuietLane, "begin", counting)
    on, w_on, named_on, bad = _run(tmp_path / "on", True, rows, frozen, dtype)
    assert BAD_STEP in lane_steps and len(lane_steps) >= BAD_STEP  # the lane took them
    off, w_off, named_off, _ = _run(tmp_path / "off", False, rows, frozen, dtype)
    assert bad == [5, rows - 1]
    assert named_on == named_off == bad  # the rows found in the data, by both paths
    assert len(on) == len(off) > BAD_STEP
    assert on == off  # every field of every recorded step (NaN == NaN by repr)
    assert all(map(torch.equal, w_on, w_off))
