"""Rollback in setups with more than one optimizer, and with frozen parameters.

- Two optimizers on one model (body: SGD with momentum, head: Adam), one `rollback` guard each,
  snapshot every step, no LR backoff: a bad batch at step K (a NaN row both optimizers see, or
  a sqrt at 0 that only the body's gradients show) ends the run bitwise equal to an unguarded
  run that never saw batch K: both optimizers' parameters AND their state (momentum, Adam
  moments and step counters), whichever optimizer steps first. Before the fix, the body's
  guard restored the head's parameters too but not the head optimizer's state, and the head's
  guard let the head learn from the bad batch.
- LoRA-style frozen base weights: the snapshot holds exactly what the optimizer trains (the
  adapter and head, their Adam state), the BatchNorm buffers and nothing else — its byte size
  is computed from the trainable parameters, whether the optimizer was given only those or
  every parameter with the frozen ones flagged; and a rollback still leaves no trace.
"""

from __future__ import annotations

import math

import pytest
import torch
from recover_helpers import DIM, assert_same, make_batches, quiet
from torch import nn

from nanguard import Guard
from nanguard.config import RecoverConfig

STEPS = 10
K = 6


class SqrtHead(nn.Module):
    """body (bias-free) -> [tanh(h), |h|_2] -> head: an all-zero input row takes sqrt at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(DIM, 16, bias=False)
        self.head = nn.Linear(17, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.head(torch.cat([torch.tanh(h), h.pow(2).sum(-1, keepdim=True).sqrt()], -1))


def _every_step() -> RecoverConfig:
    return RecoverConfig(snapshot_every=1, quiet_steps=0, backoff_factor=1.0)


def _two_optimizers(model: SqrtHead) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.body.parameters(), lr=0.05, momentum=0.9),
            torch.optim.Adam(model.head.parameters(), lr=1e-2)]


def _bad_batches(bad: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = make_batches(STEPS, seed=4)
    x, y = batches[K]
    x = x.clone()
    if bad == "nan_row":
        x[2, 3] = math.nan
    else:
        x[2] = 0.0  # sqrt at 0: NaN gradients in the body only
    batches[K] = (x, y)
    return batches


def _train_two(batches, order: str, guarded: bool):
    torch.manual_seed(0)
    model = SqrtHead()
    opts = _two_optimizers(model)
    if order == "head_first":
        opts = opts[::-1]
    guards = [Guard(model, o, config=quiet("rollback", recover=_every_step())) for o in opts
              ] if guarded else []
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        for g in guards:
            g.watch(loss=loss, batch=(x, y))
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
    for g in guards:
        g.close()
    if order == "head_first":
        opts = opts[::-1]
    return model, opts, guards


@pytest.mark.parametrize("order", ["body_first", "head_first"])
@pytest.mark.parametrize("bad", ["nan_row", "sqrt0"])
def test_two_optimizers_on_one_model_roll_back_together(bad: str, order: str) -> None:
    batches = _bad_batches(bad)
    model, opts, guards = _train_two(batches, order, guarded=True)
    ref_model, ref_opts, _ = _train_two(batches[:K] + batches[K + 1:], order, guarded=False)

    for g in guards:  # each guard rolled back once, at step K, and never gave up
        assert [(a["step"], a["action"]) for a in g.actions] == [(K, "rollback")], g.actions
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_same(model.state_dict(), ref_model.state_dict(), "model")
    for name, o, r in zip(("body", "head"), opts, ref_opts, strict=True):
        assert o.state, name  # momentum / Adam moments exist, so the comparison means something
        assert_same(o.state_dict(), r.state_dict(), f"{name} optimizer")
    # The comparison can fail: training moved every parameter.
    torch.manual_seed(0)
    init = SqrtHead()
    for (n, p), q in zip(model.named_parameters(), init.parameters(), strict=True):
        assert not torch.equal(p, q), n


# ---------------------------------------------------------------------------- frozen (LoRA)


class LoraNet(nn.Module):
    """A frozen 128x128 base linear layer with a trained rank-2 adapter, a BatchNorm (frozen
    affine, running statistics still updated) and a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, 128)
        self.base2 = nn.Linear(128, 128)
        self.down = nn.Linear(128, 2, bias=False)
        self.up = nn.Linear(2, 128, bias=False)
        self.norm = nn.BatchNorm1d(128)
        self.head = nn.Linear(128, 1)
        for m in (self.base, self.base2, self.norm):
            m.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.base(x))
        h = self.base2(h) + self.up(self.down(h))
        return self.head(torch.tanh(self.norm(h)))


def _lora(all_params: bool) -> tuple[LoraNet, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = LoraNet()
    params = (list(model.parameters()) if all_params
              else [p for p in model.parameters() if p.requires_grad])
    return model, torch.optim.Adam(params, lr=1e-2)


def _train_lora(batches, all_params: bool, guarded: bool):
    model, opt = _lora(all_params)
    guard = Guard(model, opt, config=quiet("rollback", recover=_every_step())) if guarded else None
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if guard is not None:
        guard.close()
    return model, opt, guard


@pytest.mark.parametrize("all_params", [False, True], ids=["trainable_only", "all_params"])
def test_snapshot_holds_only_what_the_optimizer_trains(all_params: bool) -> None:
    batches = _bad_batches("nan_row")
    model, opt, guard = _train_lora(batches, all_params, guarded=True)
    assert guard is not None and guard.recovery.rollbacker is not None
    snapshot = guard.recovery.rollbacker.snapshot

    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    param_bytes = sum(p.numel() * p.element_size() for p in trainable)
    adam_step = torch.zeros(()).element_size()  # Adam's 0-dim float32 step counter
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    # The parameters, Adam's exp_avg and exp_avg_sq (parameter-sized) and step, the buffers.
    expected = 3 * param_bytes + len(trainable) * adam_step + buffer_bytes
    # Each slot of the ring holds one copy of exactly that; the ring's total is their sum.
    assert [s.nbytes for s in snapshot.slots] == [expected] * len(snapshot.slots)
    assert snapshot.nbytes == len(snapshot.slots) * expected
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
    assert frozen_bytes > 10 * param_bytes  # what the fix stops copying

    # The rollback still leaves no trace: equal to a run that never saw the bad batch.
    assert [(a["step"], a["action"]) for a in guard.actions] == [(K, "rollback")]
    ref_model, ref_opt, _ = _train_lora(batches[:K] + batches[K + 1:], all_params, guarded=False)
    assert_same(model.state_dict(), ref_model.state_dict(), "model")
    assert_same(opt.state_dict(), ref_opt.state_dict(), "optimizer")
