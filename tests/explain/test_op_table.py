"""The op table on real ops: each expression runs under the op checker (real PyTorch, CPU),
and the cause is read from what the checker recorded (the op, its input ranges, its
non-tensor arguments). The expected mechanism is known from the expression itself; every
mechanism has a near miss that must not fire it (the same op at a harmless point)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from nanguard.explain import Evidence, diagnose
from nanguard.explain.undetermined import undetermined
from nanguard.pinpoint.replay import run_checked


def _found(fn: Callable[[], object]) -> tuple[dict[str, object], list[str]]:
    """The checker's finding for `fn()` and the causes of the diagnosis, best first."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std's "degrees of freedom <= 0" is expected here
        origin, _ = run_checked(fn, model=None, step=3)
    assert origin is not None, "the checker found nothing non-finite"
    first = origin.to_dict()
    causes = diagnose(Evidence(first_nonfinite=first))
    return first, [c.cause for c in causes]


def _params(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0), requires_grad=True)


# (label, failing expression, the near miss, the cause, an op the finding must name)
CASES: list[tuple[str, Callable[[], object], Callable[[], object], str, str]] = [
    ("std of one element (correction=1)",
     lambda: (_params(1) - 1).std(), lambda: (_params(2) - 1).std(),
     "division_by_zero", "aten.std"),
    ("var over a dim of size 1, unbiased",
     lambda: _params(1, 4).var(0), lambda: _params(1, 4).var(0, unbiased=False),
     "division_by_zero", "aten.var"),
    ("division by a Python scalar 0",
     lambda: torch.arange(1) / (1 - 1), lambda: torch.arange(2) / (2 - 1),
     "division_by_zero", "aten.div"),
    ("sqrt of a negative value",
     lambda: torch.sqrt(_params(4) - 5.0), lambda: torch.sqrt(_params(4).abs()),
     "domain_error", "aten.sqrt"),
    ("fractional power of a negative base",
     lambda: (_params(4) - 5.0) ** 0.5, lambda: (_params(4) - 5.0) ** 2,
     "domain_error", "aten.pow"),
    ("2 ** x past float32 (a Python base: not a domain error)",
     lambda: 2.0 ** (_params(3) * 0 + torch.tensor([-1.0, 1.0, 200.0])),
     lambda: 2.0 ** (_params(3) * 0 + torch.tensor([-1.0, 1.0, 20.0])),
     "arithmetic_overflow", "aten.pow"),
    ("acos of a cosine past 1",
     lambda: torch.acos(torch.full((3,), 1.0) + 1e-6 * torch.ones(3) * 2),
     lambda: torch.acos(torch.full((3,), 0.999)),
     "domain_error", "aten.acos"),
    ("atanh at 1",
     lambda: torch.atanh(torch.tanh(_params(3) * 100)),
     lambda: torch.atanh(torch.tanh(_params(3))),
     "domain_error", "aten.atanh"),
    ("a float64 cast to float32 beyond its range",
     lambda: torch.full((3,), 1e39, dtype=torch.float64).float(),
     lambda: torch.full((3,), 1e38, dtype=torch.float64).float(),
     "cast_overflow", "aten._to_copy"),
    ("a tensor made from Python numbers beyond float32",
     lambda: torch.tensor([1.0, 2e39, 3.0]) - 1, lambda: torch.tensor([1.0, 2e38]) - 1,
     "cast_overflow", "aten.lift_fresh"),
    ("a NumPy float64 array made float32",
     lambda: torch.as_tensor(np.array([1.0, 5e40]), dtype=torch.float32) * 2,
     lambda: torch.as_tensor(np.array([1.0, 5e30]), dtype=torch.float32) * 2,
     "cast_overflow", "aten"),
    ("0 * inf: a -inf mask multiplied in",
     lambda: (torch.tensor([0.0, -math.inf]) * torch.tensor([1.0, 0.0])).sum() + _params(1),
     lambda: (torch.tensor([0.0, -math.inf]) * torch.tensor([1.0, 1.0])).sum() + _params(1),
     "inf_arithmetic", "aten.mul"),
    ("inf - inf: a fully masked row minus its max",
     lambda: (lambda s: s - s.amax(-1, keepdim=True))(torch.full((2, 3), -math.inf)) * 2,
     lambda: (lambda s: s - s.amax(-1, keepdim=True))(torch.tensor([[0.0, -math.inf]])) * 2,
     "inf_arithmetic", "aten.sub"),
    ("a matmul of huge finite values",
     lambda: _params(2, 3) * 1e20 @ torch.full((3, 2), 1e20),
     lambda: _params(2, 3) * 1e10 @ torch.full((3, 2), 1e10),
     "arithmetic_overflow", "aten.mm"),
    ("softmax of an all -inf row",
     lambda: torch.softmax(torch.full((2, 3), -math.inf), -1),
     lambda: torch.softmax(torch.tensor([[0.0, -math.inf, 1.0]]), -1),
     "masked_softmax", "aten._softmax"),
]


@pytest.mark.parametrize(("label", "bad", "near", "cause", "op"), CASES,
                         ids=[c[0] for c in CASES])
def test_op_table_names_the_mechanism(label: str, bad: Callable[[], object],
                                      near: Callable[[], object], cause: str, op: str) -> None:
    first, causes = _found(bad)
    # An overflow of huge finite values names the op's mechanism below the dynamics rules
    # (why the values were that large: optimizer_divergence, exploding_init).
    top = cause if cause == "arithmetic_overflow" and cause in causes else causes[0]
    assert cause == "domain_error" or "domain_error" not in causes, causes
    assert (top, str(first["op"]).startswith(op)) == (cause, True), (first, causes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clean, _ = run_checked(near, model=None, step=3)
    assert clean is None, f"the near miss of {label!r} went non-finite: {clean}"


def test_scalar_divisor_and_correction_are_recorded() -> None:
    """The checker records the non-tensor arguments the table reads."""
    first, _ = _found(lambda: torch.arange(3.0) / 0.0)
    assert first["args"] == {"other": 0.0}
    first, _ = _found(lambda: _params(1, 5).std(0, correction=1))
    assert first["args"] == {"dim": [0], "correction": 1}


def test_a_python_inf_in_a_created_tensor_stays_intended() -> None:
    """`torch.tensor([0, -inf])` is a mask written on purpose: the op that turns it into NaN
    is the origin, not the tensor's creation."""
    first, causes = _found(lambda: torch.softmax(torch.tensor([[-math.inf, -math.inf]]), -1))
    assert (first["op"], first["entered"], causes[0]) == ("aten._softmax", None,
                                                          "masked_softmax")


def test_the_backward_of_sqrt_at_zero_is_singular() -> None:
    x = nn.Parameter(torch.tensor([0.0, 1.0]))
    first, causes = _found(lambda: torch.sqrt(x * x).sum().backward())
    assert (first["phase"], causes[0]) == ("backward", "singular_gradient")


def test_undetermined_names_an_op_the_table_does_not_know() -> None:
    first = {"step": 2, "phase": "forward", "op": "aten.special_zeta", "source": "t.py:3",
             "inputs": [{"min": 1.0, "max": 1.0}]}
    assert diagnose(Evidence(first_nonfinite=first)) == []
    entry = undetermined(first, alarms=[], actions=[])
    assert "aten.special_zeta is not in nanguard's op table" in entry.evidence
    known = {**first, "op": "aten.sqrt", "inputs": [{"min": 1.0, "max": 4.0}]}
    assert "no mechanism the op table has for aten.sqrt" in undetermined(
        known, alarms=[], actions=[]).evidence
