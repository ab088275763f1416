"""pinpoint/loss_expr.py on real autograd graphs: which backpropagated tensors it reads as an
expression over tagged losses (sums, differences, products with and divisions by constants),
which it refuses (anything else), and that evaluating the expression again gives the original
value bit for bit, under a dispatch mode too (replays run under the op checker)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nanguard.pinpoint import loss_expr


class Record:
    """Stands for a recorded loss call: what to compute again."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func(*args, **(kwargs or {}))


def _losses(dtype: torch.dtype = torch.float32) -> tuple[list[Record], list[torch.Tensor]]:
    torch.manual_seed(0)
    w = torch.randn(4, 1, requires_grad=True, dtype=dtype)
    x, y = torch.randn(8, 4, dtype=dtype), torch.randn(8, 1, dtype=dtype)
    fns = [lambda: F.mse_loss(x @ w, y), lambda: F.l1_loss(x @ w, y)]
    records, values = [], []
    for fn in fns:
        r = Record(fn)
        v = fn()
        loss_expr.tag(v, r)
        records.append(r)
        values.append(v)
    return records, values


@pytest.mark.parametrize("build", [
    lambda a, b: a / 4,
    lambda a, b: a * 0.37,
    lambda a, b: 0.37 * a,
    lambda a, b: a * torch.tensor(3.0),
    lambda a, b: a + b,
    lambda a, b: a - 0.5 * b,
    lambda a, b: (a + b) / 2,
    lambda a, b: torch.add(a, b, alpha=0.3),
], ids=["div-int", "mul-float", "rmul-float", "mul-tensor", "add", "sub-scaled", "mean-of-two",
        "add-alpha"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_expressions_are_read_and_evaluate_bit_for_bit(build, dtype) -> None:  # type: ignore[no-untyped-def]
    records, (a, b) = _losses(dtype)
    target = build(a, b)
    expr = loss_expr.parse(target, records)
    assert expr is not None
    with PassThrough():  # a replay runs under the op checker's dispatch mode
        again = loss_expr.evaluate(expr, lambda r: r.fn())
    assert again.dtype == target.dtype and torch.equal(again, target.detach())


@pytest.mark.parametrize("build", [
    lambda a, b: a.log(),        # an op that is not a scaling
    lambda a, b: a + 1.0,        # a constant added: not saved
    lambda a, b: sum([a, b]),    # python's sum starts from 0
    lambda a, b: 2.0 / a,        # a division by the loss
    lambda a, b: a * b,          # a product of two losses
], ids=["log", "add-constant", "builtin-sum", "reciprocal", "product"])
def test_other_arithmetic_is_refused(build) -> None:  # type: ignore[no-untyped-def]
    records, (a, b) = _losses()
    assert loss_expr.parse(build(a, b), records) is None


def test_an_untagged_loss_is_not_an_expression() -> None:
    records, (a, _) = _losses()
    other = (a.detach().requires_grad_() * 2).sum()
    assert loss_expr.parse(other / 2, records) is None
    assert loss_expr.parse(a / 2, []) is None
