"""The fix for sqrt's infinite gradient at 0 edits the user's own sqrt (issue 37, second
held-out set: siamese-triplet's `ContrastiveLoss`, `F.relu(margin - distances.sqrt())`, on a
positive pair of two identical images got the generic `torch.sqrt(x + 1e-12)`). Each finding
comes from a real backward under the op checker; a line with two sqrt keeps the general fix."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nanguard.explain import Evidence, diagnose
from nanguard.pinpoint.replay import run_checked


def _top(fn: Callable[[], object]) -> tuple[str, str]:
    origin, _ = run_checked(fn, model=None, step=0)
    assert origin is not None and origin.phase == "backward", origin
    top = diagnose(Evidence(first_nonfinite=origin.to_dict()))[0]
    return top.cause, top.fix


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(4, 2, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x = torch.ones(3, 4)  # both items of each pair the same image: identical embeddings
    return x @ w, x @ w


def _method() -> None:
    out1, out2 = _pair()
    distances = (out2 - out1).pow(2).sum(1)
    F.relu(1.0 - distances.sqrt()).pow(2).mean().backward()


def _call() -> None:
    out1, out2 = _pair()
    d = (out2 - out1).pow(2).sum(1)
    F.relu(1.0 - torch.sqrt(d)).pow(2).mean().backward()


def _two() -> None:
    out1, out2 = _pair()
    d = (out2 - out1).pow(2).sum(1)
    (F.relu(1.0 - d.sqrt()) + 0 * d.sqrt()).mean().backward()


def test_the_sqrt_method_on_the_line_gets_its_epsilon_in_place() -> None:
    cause, fix = _top(_method)
    assert cause == "singular_gradient"
    assert fix.startswith("`distances.sqrt()` -> `(distances + 1e-12).sqrt()` at this line"), fix


def test_a_torch_sqrt_call_gets_its_epsilon_in_place() -> None:
    cause, fix = _top(_call)
    assert cause == "singular_gradient"
    assert fix.startswith("`torch.sqrt(d)` -> `torch.sqrt(d + 1e-12)` at this line"), fix


def test_a_line_with_two_sqrt_keeps_the_general_fix() -> None:
    cause, fix = _top(_two)
    assert cause == "singular_gradient"
    assert fix.startswith("`torch.sqrt(x + 1e-12)`; for a norm"), fix
