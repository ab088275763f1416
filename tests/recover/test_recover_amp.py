"""Mixed precision on CPU: `torch.autocast("cpu", float16)` (bfloat16 where float16 autocast does
not work, skipped if neither does) with a `torch.amp.GradScaler("cpu")` handed to the guard.

- An overflow the scaler skips (one step's loss blown up past the dtype's range) is expected:
  an `amp_skip` action, no alarm at all, and training goes on.
- A collapse is an `amp_collapse` alarm: the scale crossing `AmpConfig(min_scale=...)` while
  steps still happen (seen in the pre-hook), and every step overflowing so that the optimizer,
  and so the guard's hooks, never run again (seen through `watch(loss=...)`, the stall path).
"""

from __future__ import annotations

import math

import pytest
import torch
from recover_helpers import make_batches, make_model, quiet

from nanguard import Guard
from nanguard.config import AmpConfig


def _amp_dtype() -> torch.dtype | None:
    for dtype in (torch.float16, torch.bfloat16):
        try:
            lin = torch.nn.Linear(4, 4)
            with torch.autocast("cpu", dtype=dtype):
                out = lin(torch.randn(2, 4))
            out.float().sum().backward()
            if out.dtype == dtype:
                return dtype
        except (RuntimeError, TypeError):
            continue
    return None


DTYPE = _amp_dtype()
pytestmark = pytest.mark.skipif(DTYPE is None, reason="no float16/bfloat16 autocast on this CPU")


def _run(steps: int, blow_up, *, amp: AmpConfig | None = None) -> tuple[Guard, list[float]]:
    """Train under autocast + GradScaler; `blow_up(i)` is the factor step i's loss is scaled by
    (a factor past the dtype's range makes the scaler skip the step)."""
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    cfg = quiet("observe", amp=amp) if amp is not None else quiet("observe")
    guard = Guard(model, opt, scaler=scaler, config=cfg)
    scales = []
    for i, (x, y) in enumerate(make_batches(steps)):
        with torch.autocast("cpu", dtype=DTYPE):
            loss = torch.nn.functional.mse_loss(model(x).float(), y) * blow_up(i)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    guard.close()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return guard, scales


OVERFLOW = torch.finfo(DTYPE).max / 10 if DTYPE is not None else 1.0


def test_expected_overflow_is_counted_not_alarmed():
    k = 12
    guard, scales = _run(25, lambda i: OVERFLOW if i == k else 1.0)
    assert scales[k] == scales[k - 1] / 2, "the scaler did not skip the blown-up step"
    skips = [a for a in guard.actions if a["action"] == "amp_skip"]
    assert skips and all("skipped 1 step" in a["detail"] for a in skips)
    assert guard.alarms == []
    assert guard.report is not None and guard.report.alarms == []


def test_scale_below_min_scale_is_a_collapse():
    k = 12
    guard, scales = _run(
        20, lambda i: OVERFLOW if i == k else 1.0, amp=AmpConfig(min_scale=0.75 * 2**15)
    )
    assert min(scales) < 0.75 * 2**15 <= max(scales)
    collapses = [a for a in guard.alarms if a.kind == "amp_collapse"]
    assert len(collapses) == 1 and collapses[0].signal == "loss_scale"
    assert collapses[0].value < 0.75 * 2**15


def test_every_step_skipped_is_a_collapse_through_watch():
    k = 10  # from step k on, every step overflows: no optimizer step, no hook ever runs again
    guard, scales = _run(45, lambda i: math.inf if i >= k else 1.0)
    steps_before = guard.step
    assert steps_before <= k and scales[-1] < 1.0
    collapses = [a for a in guard.alarms if a.kind == "amp_collapse"]
    assert collapses, "no amp_collapse alarm when every step was skipped"
    assert "collapsed" in collapses[0].message and collapses[0].value < scales[k - 1]
    # Seen through watch(): the guard's step counter never moved past the last real step.
    assert all(a.step == steps_before for a in collapses)
    assert any(a["action"] == "amp_skip" for a in guard.actions)
