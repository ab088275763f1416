"""Guard(replay=...): the first failing step is replayed in process under the op checker, the
finding names phase / module / op / samples / source and whether it reproduced, the diagnosis
uses it, and observing with a replay still leaves the parameters bitwise identical."""

from __future__ import annotations

import torch
from torch import nn

import nanguard
from nanguard.config import GuardConfig, RecordConfig


class SqrtNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8, bias=False)  # a zero input row gives h == 0 exactly
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(torch.sqrt(h * h))  # |h|, but sqrt at 0 has an infinite gradient


class MaskedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y, _ = self.attn(x, x, x, key_padding_mask=mask)
        return self.out(y.mean(1))


def _run(model, batches, loss_of, guard: bool = True, replay: bool = True):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = None
    if guard:
        g = nanguard.Guard(
            model,
            opt,
            out="",
            replay=(lambda b: loss_of(model, b)) if replay else None,
            config=GuardConfig(record=RecordConfig(summary=False)),
        )
    for batch in batches:
        loss = loss_of(model, batch)
        if g is not None:
            g.watch(loss=loss, batch=batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if g is not None:
        g.close()
    return g


def _sqrt_batches():
    gen = torch.Generator().manual_seed(1)
    for step in range(12):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        if step == 8:
            x[2] = 0.0
        yield x, y


def _sqrt_loss(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _sqrt_model() -> SqrtNet:
    torch.manual_seed(0)
    return SqrtNet()


def test_backward_origin_is_named_and_diagnosed() -> None:
    g = _run(_sqrt_model(), _sqrt_batches(), _sqrt_loss)
    first = g.report.first_nonfinite
    assert first["step"] == 8
    assert first["phase"] == "backward"
    assert first["node"] == "SqrtBackward0"
    assert first["module"] == ""  # the sqrt runs in the root module's forward
    assert first["samples"] == [2]
    assert first["reproduced"] is True
    assert first["source"].endswith(".py:22")  # the torch.sqrt line above
    assert g.report.diagnosis[0]["cause"] == "singular_gradient"


def test_masked_softmax_origin() -> None:
    torch.manual_seed(0)
    model = MaskedAttention()
    gen = torch.Generator().manual_seed(2)
    batches = []
    for step in range(6):
        x = torch.randn(4, 5, 8, generator=gen)
        mask = torch.zeros(4, 5, dtype=torch.bool)
        if step == 4:
            mask[1] = True  # every key of sample 1 masked
        batches.append((x, mask, torch.randn(4, 1, generator=gen)))

    def loss_of(m, b):
        return nn.functional.mse_loss(m(b[0], b[1]), b[2])

    g = _run(model, batches, loss_of)
    first = g.report.first_nonfinite
    assert first["step"] == 4
    assert first["phase"] == "forward"
    assert first["op"] in ("aten._softmax", "aten._safe_softmax", "aten._masked_softmax")
    assert first["module"] == "attn"
    assert g.report.diagnosis[0]["cause"] == "masked_softmax"


def _sqrt_trajectory(guarded: bool, steps: int = 9):
    """Train `SqrtNet` on the sqrt batches (the zero row at step 8), observed with a replay or
    unguarded; return the parameters after every step and the guard."""
    model = _sqrt_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = None
    if guarded:
        g = nanguard.Guard(model, opt, out="", replay=lambda b: _sqrt_loss(model, b),
                           config=GuardConfig(record=RecordConfig(summary=False)))
    trajectory = []
    for batch in list(_sqrt_batches())[:steps]:
        loss = _sqrt_loss(model, batch)
        if g is not None:
            g.watch(loss=loss, batch=batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        trajectory.append({n: p.detach().clone() for n, p in model.named_parameters()})
    if g is not None:
        g.close()
    return trajectory, g


def test_observe_with_replay_is_bitwise_non_invasive() -> None:
    """Every step, through the replayed one: parameters bitwise equal to the unguarded run.

    The runs stop right after step 8 (the replayed step): its NaN gradient reaches `body` only,
    `head` stays finite and trained, so the comparison holds real numbers (once every
    parameter is NaN, as it is a step later, any two runs would compare equal)."""
    guarded, g = _sqrt_trajectory(True)
    plain, _ = _sqrt_trajectory(False)
    assert g is not None and g.report.first_nonfinite["step"] == 8
    assert g.report.first_nonfinite["reproduced"] is True  # the replay did run
    init = dict(_sqrt_model().named_parameters())
    last = guarded[-1]
    assert torch.isnan(last["body.weight"]).all()  # the failing update went through
    for name in ("head.weight", "head.bias"):  # finite after the replayed step, and trained
        assert torch.isfinite(last[name]).all() and not torch.equal(last[name], init[name])
    assert len(guarded) == len(plain) == 9
    for step, (pa, pb) in enumerate(zip(guarded, plain, strict=True)):
        for name in pa:
            a, b = pa[name], pb[name]
            same_nan = torch.equal(a.isnan(), b.isnan())
            assert same_nan and torch.equal(a[~a.isnan()], b[~b.isnan()]), (
                f"{name} differs after step {step}")
