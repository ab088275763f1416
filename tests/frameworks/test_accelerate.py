"""Accelerate recipe from the README: `Guard(model, optimizer.optimizer)` on the
`accelerator.prepare`d model and optimizer, with gradient accumulation (2 micro-batches per
step). A NaN row in the first micro-batch of a step is found at that optimizer step (not hidden
by the finite second micro-batch) and `skip` discards exactly that update."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402

from nanguard import Guard, GuardConfig, RecordConfig  # noqa: E402

STEPS, ACC, BAD_STEP = 8, 2, 3


def test_prepared_model_and_optimizer_with_accumulation(tmp_path):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACC)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model, opt = accelerator.prepare(model, opt)
    guard = Guard(model, opt.optimizer, policy="skip", out=tmp_path / "run",
                  config=GuardConfig(record=RecordConfig(summary=False)))
    g = torch.Generator().manual_seed(1)
    after: list[list[torch.Tensor]] = []
    for micro in range(STEPS * ACC):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        if micro == BAD_STEP * ACC:  # the first micro-batch of step BAD_STEP
            x[6, 0] = float("nan")
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            after.append([p.detach().clone() for p in model.parameters()])
    report = guard.close()
    assert report.steps == STEPS
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["step"] == BAD_STEP
    assert report.first_nonfinite["phase"] == "data"
    assert [(a["step"], a["action"]) for a in report.actions] == [(BAD_STEP, "skip")]
    for a, b in zip(after[BAD_STEP - 1], after[BAD_STEP], strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in model.parameters())
