"""Adaptive, NaN-safe clipping (`GuardConfig(clip=ClipConfig(...))`) on real training.

- A gradient spike (one batch scaled 30x after the warm-up) is clipped: action `clip`, and the
  gradient norm the update then uses is at most the threshold the clipper held before the step.
- A non-finite gradient norm (NaN or inf in one batch) skips the update (parameters unchanged)
  and leaves the clipper's mean / var / count exactly as they were, and finite; an EMA fed the
  same NaN, as a plain z-score clipper would do, is poisoned for good.
"""

from __future__ import annotations

import math

import pytest
import torch
from recover_helpers import make_batches, make_model, poison, quiet

from nanguard import Guard
from nanguard.config import ClipConfig
from nanguard.recover import AdaptiveClipper

WARMUP = 10


def _setup():
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = Guard(model, opt, config=quiet("observe", clip=ClipConfig(warmup_steps=WARMUP)))
    norms_used: list[float] = []  # registered after the guard's hook: the grads the update uses

    def measure(optimizer, args, kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norms_used.append(
            torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
            if grads
            else math.nan
        )

    opt.register_step_pre_hook(measure)
    return model, opt, guard, norms_used


def _step(model, opt, guard, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    guard.watch(loss=loss, batch=(x, y))
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_spike_is_clipped_to_the_threshold():
    k = 25
    model, opt, guard, norms_used = _setup()
    clipper = guard.recovery.clipper
    assert clipper is not None
    threshold = None
    for i, (x, y) in enumerate(make_batches(35)):
        if i == k:
            x = x * 30
            threshold = clipper.threshold()
        _step(model, opt, guard, x, y)
    guard.close()
    # (a z of 3 also trims the odd ordinary step; the spike is the one that matters here)
    clips = {a["step"]: a for a in guard.actions if a["action"] == "clip"}
    assert k in clips and "clipped by" in clips[k]["detail"], guard.actions
    assert threshold is not None and math.isfinite(threshold)
    assert norms_used[k] <= threshold * (1 + 1e-5), (norms_used[k], threshold)
    assert norms_used[k] >= 0.99 * threshold  # scaled down to it, not zeroed
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_norm_skips_and_keeps_statistics(bad):
    k = 20
    model, opt, guard, _ = _setup()
    clipper = guard.recovery.clipper
    assert clipper is not None
    for i, (x, y) in enumerate(make_batches(30)):
        if i == k:
            if bad == "nan":
                x, y = poison((x, y))
            else:
                x = x.clone()
                x[0, 0] = 3e38  # finite input, the forward overflows float32 to inf
            before = (clipper.mean, clipper.var, clipper.count)
            params = [p.detach().clone() for p in model.parameters()]
        _step(model, opt, guard, x, y)
        if i == k:
            assert (clipper.mean, clipper.var, clipper.count) == before
            assert all(map(math.isfinite, before))
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params, strict=True))
    guard.close()
    skips = [a for a in guard.actions if a["action"] == "skip"]
    assert [a["step"] for a in skips] == [k]
    assert "clip statistics kept" in skips[0]["detail"]
    assert clipper.count == 29 and math.isfinite(clipper.mean) and math.isfinite(clipper.var)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    # What the clipper avoids: an EMA fed the NaN norm (as ZClip-style statistics would be).
    naive = AdaptiveClipper(clipper.config)
    naive.load_state_dict(clipper.state_dict())
    naive._update(math.nan)
    assert math.isnan(naive.mean) and naive.threshold() is not None
    assert math.isnan(naive.threshold())
