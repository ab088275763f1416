"""The zero-code re-run's `reproduced` compares the loss in the units `nanguard run` recorded
it in: a loss divided for gradient accumulation is recorded undivided, and a re-run that
repeats the step bit for bit must not read as non-deterministic (cnn_workers.py's data NaN
was diagnosed `nondeterministic (70%)` for that alone)."""

from __future__ import annotations

import torch
from torch import nn

from nanguard.pinpoint import armed

ACCUM = 4
NAN_STEP = 2


def _train(record: list[float]) -> None:
    """Seeded CPU training, accumulation over ACCUM micro-batches, a NaN in the first
    micro-batch of update NAN_STEP; `record` gets each update's last micro-batch loss in the
    script's units (undivided), as the script would print it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for update in range(4):
        for micro in range(ACCUM):
            x, y = torch.randn(8, 6), torch.randn(8, 1)
            if update == NAN_STEP and micro == 0:
                x[3, 2] = float("nan")
            loss = nn.functional.mse_loss(model(x), y)
            (loss / ACCUM).backward()
        record.append(loss.item())
        opt.step()
        opt.zero_grad()


def test_a_repeated_step_of_a_divided_loss_is_reproduced() -> None:
    losses: list[float] = []
    _train(losses)  # the plain run: its own loss at the failing update, finite (last micro)
    assert torch.isfinite(torch.tensor(losses[NAN_STEP]))
    with armed(NAN_STEP, expect_loss=losses[NAN_STEP]) as a:
        _train([])
    assert a.origin is not None and a.origin.phase == "data", a.origin
    assert a.origin.reproduced is True
    # The other side: a loss the step did not give is no reproduction.
    with armed(NAN_STEP, expect_loss=losses[NAN_STEP] * 1.5) as b:
        _train([])
    assert b.origin is not None and b.origin.reproduced is False
