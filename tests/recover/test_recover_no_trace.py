"""After `skip` and after `rollback`, no trace of the bad step remains, bit for bit.

skip: a NaN planted in step K's batch ends the run bitwise equal (parameters and the whole
optimizer state: Adam exp_avg / exp_avg_sq / step, SGD momentum) to an unguarded run that never
saw batch K.

rollback (snapshot_every=S, backoff_factor=1.0): the guard refreshes its snapshot in the
post-hook of step n-1 (`maybe_capture(n)`: the state at the start of step n) when n % S == 0 and
the run is quiet, and captures the initial state when it is built. A NaN at step K therefore
restores the state of step s = (K // S) * S, and the run ends bitwise equal to an unguarded run
on batches [0, s) then (K, end): parameters, BatchNorm buffers (poisoned by the NaN forward),
optimizer state (param-group LR included), the scheduler's state (a closed-form LambdaLR and
a chainable ExponentialLR) and the RNG (a Dropout draws from it) included. The LR each update
uses is the one the reference run uses at the same position.

Also: the LR backoff (x factor for `backoff_steps` updates after a rollback, compounding on a
second one, the scheduler's LR back in place after every step) and giving up after
`max_rollbacks` (NanguardError, action `give_up`).
"""

from __future__ import annotations

import pytest
import torch
from recover_helpers import (
    assert_same,
    assert_same_training,
    lr_used,
    make_batches,
    make_model,
    make_optimizer,
    poison,
    quiet,
    train,
)

from nanguard import Guard, NanguardError
from nanguard.config import RecoverConfig

STEPS = 30
S = 5


def _lam(t: int) -> float:
    return 1.0 / (1.0 + 0.1 * t)


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_skip_leaves_no_trace(kind):
    k = 11
    batches = make_batches(STEPS)
    model = make_model(0)
    opt = make_optimizer(kind, model)
    guard = Guard(model, opt, config=quiet("skip"))
    train(model, opt, [poison(b) if i == k else b for i, b in enumerate(batches)], guard=guard)
    guard.close()
    assert [(a["step"], a["action"]) for a in guard.actions] == [(k, "skip")]

    ref_model = make_model(0)
    ref_opt = make_optimizer(kind, ref_model)
    train(ref_model, ref_opt, batches[:k] + batches[k + 1 :])
    assert_same_training(model, opt, ref_model, ref_opt)
    if kind == "adam":
        assert all(int(s["step"]) == STEPS - 1 for s in opt.state.values())


def _scheduler(name: str, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    if name == "lambda":  # closed form: the LR from the step count alone
        return torch.optim.lr_scheduler.LambdaLR(opt, _lam)
    return torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)  # chainable: builds on group["lr"]


@pytest.mark.parametrize("sched_name", ["lambda", "exponential"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("k", [3, 12, 15])  # back to the initial state; mid-interval; on a K
def test_rollback_leaves_no_trace(kind, k, sched_name):
    s = (k // S) * S
    batches = make_batches(STEPS)

    model = make_model(0, bn_dropout=True)
    opt = make_optimizer(kind, model)
    sched = _scheduler(sched_name, opt)
    cfg = quiet("rollback", recover=RecoverConfig(snapshot_every=S, backoff_factor=1.0))
    guard = Guard(model, opt, scheduler=sched, config=cfg)
    used = lr_used(opt)
    train(
        model,
        opt,
        [poison(b) if i == k else b for i, b in enumerate(batches)],
        guard=guard,
        scheduler=sched,
    )
    guard.close()
    rng_end = torch.get_rng_state()
    assert [(a["step"], a["action"]) for a in guard.actions] == [(k, "rollback")]
    assert f"restored the state of step {s}," in guard.actions[0]["detail"]
    assert not any(torch.isnan(b).any() for b in model.buffers() if b.is_floating_point())

    ref_model = make_model(0, bn_dropout=True)
    ref_opt = make_optimizer(kind, ref_model)
    ref_sched = _scheduler(sched_name, ref_opt)
    ref_used = lr_used(ref_opt)
    train(ref_model, ref_opt, batches[:s] + batches[k + 1 :], scheduler=ref_sched)

    assert_same_training(model, opt, ref_model, ref_opt)
    assert_same(sched.state_dict(), ref_sched.state_dict(), "scheduler")
    assert_same(rng_end, torch.get_rng_state(), "rng")  # dropout drew the same masks
    # The LR of every update: the schedule up to K; after K, the reference's from step s on.
    assert used[:k] == ref_used[:k]
    assert used[k + 1 :] == ref_used[s:]


def test_rollback_backs_off_the_lr_and_gives_up():
    n = 4  # backoff_steps
    bad = (12, 27, 33)
    batches = make_batches(40)
    model = make_model(0)
    opt = make_optimizer("sgd", model)
    base = opt.param_groups[0]["lr"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lam)
    cfg = quiet(
        "rollback",
        recover=RecoverConfig(
            snapshot_every=S, backoff_factor=0.5, backoff_steps=n, max_rollbacks=2
        ),
    )
    guard = Guard(model, opt, scheduler=sched, config=cfg)
    used = lr_used(opt)
    after: list[tuple[float, float]] = []  # (lr after the step, what the scheduler alone gives)

    def check(i: int) -> None:
        after.append((opt.param_groups[0]["lr"], base * _lam(sched.last_epoch)))

    with pytest.raises(NanguardError) as info:
        train(
            model,
            opt,
            [poison(b) if i in bad else b for i, b in enumerate(batches)],
            guard=guard,
            scheduler=sched,
            on_step=check,
        )

    assert [(a["step"], a["action"]) for a in guard.actions] == [
        (12, "rollback"),
        (27, "rollback"),
        (33, "give_up"),
    ]
    assert "restored the state of step 10," in guard.actions[0]["detail"]
    # Quiet steps after the first rollback: the next snapshot is at 25 (25 - 12 > 10).
    assert "restored the state of step 25," in guard.actions[1]["detail"]
    assert info.value.report.actions[-1]["action"] == "give_up"
    assert len(after) == 33  # stopped inside step 33's optimizer.step()

    # After every step, the LR is the scheduler's own (the backoff never leaks into it).
    assert all(lr == expected for lr, expected in after)
    # The first rollback kept the LR (its batch held the NaN: the data, not the LR); the
    # second, within the window, compounded: the scheduler's LR x 0.5 for n steps after it.
    # The rolled-back steps made no update.
    assert "LR kept: the batch itself held" in guard.actions[0]["detail"]
    assert "LR x0.5 for 4 steps" in guard.actions[1]["detail"]
    factor = {i: 0.5 for i in range(28, 28 + n)}
    scheduled = [base * _lam(0)] + [e for _, e in after]  # the scheduler's LR before each step
    for i, lr in enumerate(used[:33]):
        if i in bad:
            continue
        assert lr == scheduled[i] * factor.get(i, 1.0), (i, lr, scheduled[i])
