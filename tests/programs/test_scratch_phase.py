"""The phase of an op in code with no `nn.Module` (d2l-style from-scratch programs): the scratch
model's ops are `forward`, the loss begins at its first log, loss function or pick of one
probability per row at the targets (issue 37's second held-out set; before, every op before
backward was `loss`). Established on the held-out programs (BENCHMARKS.md): d2l's softmax
regression (`exp` of the logits: forward; `-log(y_hat[range(n), y])`: loss), makemore's batch
norm by hand (`hpreact.std(0)`: forward) and its bigram network (`logits.exp()`: forward;
`-probs[arange(n), ys].log()`: loss). Each origin comes from real ops under the op checker,
its expected phase from where the op sits in the function (the comment on its line)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from nanguard.pinpoint.replay import run_checked

_G = torch.Generator().manual_seed(0)


def _phase(fn: Callable[[], object]) -> tuple[str, str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # std's "degrees of freedom <= 0" is expected
        origin, _ = run_checked(fn, model=None, step=0)
    assert origin is not None
    return origin.op, origin.phase


def _softmax_overflow() -> torch.Tensor:
    X = torch.randn(4, 3, generator=_G) * 100
    W = torch.randn(3, 5, generator=_G, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3])
    counts = (X @ W).exp()  # forward: the scratch model's softmax
    probs = counts / counts.sum(1, keepdim=True)
    return -probs[torch.arange(4), y].log().mean()


def _picked_log_of_zero() -> torch.Tensor:
    W = torch.tensor([[-30.0, 80.0, 1.0]], requires_grad=True)
    xenc = torch.ones(2, 1)
    counts = (xenc @ W).exp()
    probs = counts / counts.sum(1, keepdim=True)
    ys = torch.tensor([0, 1])
    return -probs[torch.arange(2), ys].log().mean()  # loss: the picked probability is 0


def _one_row_batch_norm() -> torch.Tensor:
    C = torch.randn(27, 4, generator=_G, requires_grad=True)
    W = torch.randn(8, 6, generator=_G, requires_grad=True)
    Xb = torch.tensor([[1, 2]])
    emb = C[Xb].view(1, -1)  # one index tensor: an embedding lookup, not a pick
    h = emb @ W
    hn = (h - h.mean(0, keepdim=True)) / h.std(0, keepdim=True)  # forward: n = 1
    return torch.nn.functional.cross_entropy(hn, torch.tensor([3]))


def _bce_by_hand() -> torch.Tensor:
    z = torch.tensor([20.0, -1.0], requires_grad=True)
    y = torch.tensor([0.0, 1.0])
    h = torch.sigmoid(z)
    return -(y * torch.log(h) + (1 - y) * torch.log(1 - h)).mean()  # loss: log(1 - 1.0)


def test_the_scratch_models_ops_are_forward() -> None:
    assert _phase(_softmax_overflow) == ("aten.exp", "forward")
    assert _phase(_one_row_batch_norm) == ("aten.std", "forward")


def test_the_loss_begins_at_its_log_or_its_pick() -> None:
    assert _phase(_picked_log_of_zero) == ("aten.log", "loss")
    assert _phase(_bce_by_hand) == ("aten.log", "loss")
