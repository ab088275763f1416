"""Without `replay=`, the module blamed for a backward NaN does not depend on how the optimizer's
param groups are ordered.

The NaN is made in backward after the head (the loss takes `sqrt(out * out)`, and an all-zero
input row gives out == 0 exactly: an infinite derivative times 0), so it reaches the head's
gradients first and the body's next.
The cheap, always-on answer (no replay) must name the head whatever the order of the groups: it
is the module where backward first showed the value (module order, not parameter order).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig


def _run(order: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential()
    # Bias-free: an all-zero input row gives an exactly zero output.
    model.add_module("body", nn.Linear(6, 8, bias=False))
    model.add_module("act", nn.Tanh())
    model.add_module("head", nn.Linear(8, 1, bias=False))
    body, head = model.body.parameters(), model.head.parameters()
    groups = ([{"params": head, "lr": 0.1}, {"params": body, "lr": 0.01}] if order == "head_first"
              else [{"params": body, "lr": 0.01}, {"params": head, "lr": 0.1}])
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    guard = nanguard.Guard(model, opt, out="", config=GuardConfig(record=RecordConfig(
        summary=False)))
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        x, y = torch.randn(8, 6, generator=gen), torch.rand(8, 1, generator=gen)
        if step == 2:
            x[5] = 0.0
        out = model(x)
        loss = nn.functional.mse_loss(torch.sqrt(out * out), y)  # |out|: sqrt at 0 for row 5
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    report = guard.close()
    assert report.first_nonfinite is not None
    return report.first_nonfinite


@pytest.mark.parametrize("order", ["body_first", "head_first"])
def test_backward_blame_follows_module_order_not_param_groups(order: str) -> None:
    first = _run(order)
    assert first["step"] == 2 and first["phase"] == "backward", first
    assert first["module"] == "head", first
