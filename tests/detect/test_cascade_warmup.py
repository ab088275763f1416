"""A momentum buffer filling from zero is not an early cascade; growing gradients still are.

Seen on a public forward-forward MNIST program: Adam's first-moment norm grew 46x over its
first three steps (5.9e-5 -> 2.7e-3) while the loss fell, and the run ended `warned`."""

from __future__ import annotations

import torch

import nanguard
from nanguard import GuardConfig, RecordConfig


def _cascades(scales: list[float]) -> list[tuple[int, str]]:
    """Adam on `w . x` with x = scale * ones: the gradient is x, so its norm is set per step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = nanguard.Guard(model, opt, out="", config=GuardConfig(record=RecordConfig(summary=False)))
    for scale in scales:
        loss = model(torch.full((1, 4), float(scale))).sum()
        g.watch(loss=loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    rep = g.close()
    return [(a["step"], a["signal"]) for a in rep.alarms if a["kind"] == "cascade"]


def test_adams_first_moment_filling_up_is_no_cascade():
    scales = [1.0, 6.0, 12.0, 18.0] + [18.0] * 8
    # Independent of nanguard: Adam's exp_avg (beta1 0.9, from zero) over these gradients
    # grows past the early-growth bar (30x in three steps) while the gradients grow 18x.
    m, norms = 0.0, []
    for s in scales[:4]:
        m = 0.9 * m + 0.1 * s
        norms.append(m)
    assert norms[3] / norms[0] > 30 and scales[3] / scales[0] < 30
    assert _cascades(scales) == []


def test_gradients_exploding_early_are_still_a_cascade():
    found = _cascades([1.0, 10.0, 100.0, 1000.0, 1000.0])
    assert (3, "grad_norm") in found, found
