"""Samples a rollback named are left out when they come back: a batch with a NaN row makes the
`rollback` policy roll back (LR kept: the data, not the LR); the next epochs hand the same
batch again, and its update is discarded before it lands (a `skip` naming the sample's
fingerprint), with no second rollback and no compounded LR backoff. Real training: the tiny MLP
of recover_helpers, three epochs of the same 10 batches."""

from __future__ import annotations

import torch
from recover_helpers import make_batches, make_model, make_optimizer, poison, quiet, train

from nanguard import Guard
from nanguard.config import RecoverConfig

EPOCH = 10
BAD = 4


def test_a_nan_sample_is_left_out_in_later_epochs() -> None:
    batches = make_batches(EPOCH)
    batches[BAD] = poison(batches[BAD])
    model = make_model(0)
    opt = make_optimizer("sgd", model)
    guard = Guard(model, opt, config=quiet("rollback", recover=RecoverConfig(snapshot_every=2)))
    before: dict[int, list[torch.Tensor]] = {}
    after: dict[int, list[torch.Tensor]] = {}

    def note(i: int) -> None:
        after[i] = [p.detach().clone() for p in model.parameters()]

    opt.register_step_pre_hook(
        lambda o, a, k: before.__setitem__(len(before), [p.detach().clone()
                                                         for p in model.parameters()]))
    losses = train(model, opt, batches * 3, guard=guard, on_step=note)
    guard.close()
    acts = [(a["step"], a["action"]) for a in guard.actions]
    assert acts == [(BAD, "rollback"), (EPOCH + BAD, "skip"), (2 * EPOCH + BAD, "skip")], acts
    assert "1 sample(s) left out from now on" in guard.actions[0]["detail"]
    assert "LR kept" in guard.actions[0]["detail"]
    fp = guard.actions[0]["detail"].split("fingerprint(s) ")[1].rstrip(")")
    for a in guard.actions[1:]:
        assert "left out after the rollback at step 4" in a["detail"] and fp in a["detail"]
    # The left-out steps changed no parameter; every other step of epochs 2-3 did.
    for i in (EPOCH + BAD, 2 * EPOCH + BAD):
        assert all(torch.equal(p, q) for p, q in zip(before[i], after[i], strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(before[EPOCH + 1], after[EPOCH + 1],
                                                     strict=True))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0]
    cost = guard.report.run["recovery"] if guard.report else {}
    assert cost["samples_left_out"] == 1 and cost["updates_left_out"] == 2
    assert cost["rollbacks"] == 1 and cost["lr_factor"] == 1.0
