"""The fix for a log of a probability that rounded to 0 in a hand-written loss is the one the
user's line needs (issue 37, found on a held-out program: makemore's bigram network,
`-probs[torch.arange(num), ys].log()` after a softmax written as `counts / counts.sum(1)`,
got a list of three fixes, two of them for a sigmoid). Each finding comes from real ops under
the op checker: a probability picked at the targets gets `F.cross_entropy` on the logits; a
hand-written binary cross-entropy gets `binary_cross_entropy_with_logits`; a line that says
neither keeps the general fix."""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanguard.explain import Evidence, diagnose
from nanguard.pinpoint.replay import run_checked


def _top(fn: Callable[[], object]) -> tuple[str, str]:
    origin, _ = run_checked(fn, model=None, step=0)
    assert origin is not None and origin.op == "aten.log", origin
    top = diagnose(Evidence(first_nonfinite=origin.to_dict()))[0]
    return top.cause, top.fix


def _picked() -> torch.Tensor:
    logits = torch.tensor([[-30.0, 80.0, 1.0], [2.0, 0.0, 3.0]], requires_grad=True)
    counts = logits.exp()
    probs = counts / counts.sum(1, keepdim=True)  # exp(-30) / exp(80) rounds to 0 in float32
    ys = torch.tensor([0, 2])
    return -probs[torch.arange(len(ys)), ys].log().mean()


def _complement() -> torch.Tensor:
    z = torch.tensor([20.0, -1.0], requires_grad=True)
    y = torch.tensor([0.0, 1.0])
    h = torch.sigmoid(z)  # sigmoid(20) rounds to 1.0 in float32
    return -(y * torch.log(h) + (1 - y) * torch.log(1 - h)).mean()


def _plain() -> torch.Tensor:
    z = torch.tensor([[-30.0, 80.0]], requires_grad=True)
    p = torch.softmax(z, dim=1)
    return -torch.log(p).mean()


def test_a_probability_picked_at_the_targets_gets_cross_entropy_on_the_logits() -> None:
    cause, fix = _top(_picked)
    assert cause == "saturated_loss"
    assert fix.startswith("compute the loss from the logits that made `probs`: "
                          "`F.cross_entropy(logits, ys)`"), fix
    assert "sigmoid" not in fix


def test_a_hand_written_binary_cross_entropy_gets_the_with_logits_loss() -> None:
    cause, fix = _top(_complement)
    assert cause == "saturated_loss"
    assert "`F.binary_cross_entropy_with_logits(z, y)`" in fix and "cross_entropy(logits" not in fix


def test_a_line_that_names_no_loss_keeps_the_general_fix() -> None:
    cause, fix = _top(_plain)
    assert cause == "saturated_loss"
    assert fix.startswith("`F.binary_cross_entropy(torch.sigmoid(z), y)` ->"), fix
