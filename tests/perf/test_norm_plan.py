"""NormPlan (many small CPU tensors, one kernel per shape) gives what `_foreach_norm` gives."""

from __future__ import annotations

import math

import torch
from torch import nn

from nanguard.watch.norms import NormPlan, foreach_norms


def _blocks(n: int = 40) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)) for _ in range(n)])


def test_plan_equals_foreach_with_nan_and_inf() -> None:
    params = [p.detach().clone() for p in _blocks().parameters()]
    assert NormPlan.worth(params)
    params[3][0] = math.nan
    params[10][1] = math.inf
    params[20].mul_(1e30)  # a float32 sum of squares that overflows: inf, as foreach says
    plan = NormPlan(params)
    got, want = plan.norms(params), foreach_norms(params)
    assert got is not None and got.dtype == torch.float64
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_plan_declines_what_it_does_not_fit() -> None:
    params = [p.detach().clone() for p in _blocks().parameters()]
    plan = NormPlan(params)
    assert plan.norms(params[:-1]) is None  # not aligned with the parameters
    assert plan.norms([p.double() for p in params]) is None  # converted after the plan
    resized = list(params)
    resized[0] = torch.zeros(17, 16)
    assert plan.norms(resized) is None  # a parameter resized within its group
    assert not NormPlan.worth(params[:4])  # few tensors: `_foreach_norm` is as cheap
    assert not NormPlan.worth([torch.zeros(512, 512)] * 20)  # large: the stack costs more


def test_guard_measures_a_many_tensor_model_through_the_plan() -> None:
    from nanguard import Guard, GuardConfig, RecordConfig

    model = _blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    guard = Guard(model, opt, out="", config=GuardConfig(record=RecordConfig(summary=False)))
    x = torch.randn(8, 16)
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    guard.watch(loss=loss)
    opt.step()
    stats = guard.history[-1]
    guard.close()
    assert guard.probe.plan is not None  # the plan was used and still fits
    want = foreach_norms(grads).tolist()
    assert [stats.grad_norms[i] for i in range(len(grads))] == want
    momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert [stats.state_norms["momentum_buffer"][i] for i in range(len(grads))] == \
        foreach_norms(momentum).tolist()
