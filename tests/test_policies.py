"""Policies on a poisoned step (a NaN in one input row at step K).

`skip`: parameters and optimizer state (Adam step counters and moments, SGD momentum) are bitwise
unchanged across step K, the action is recorded in the report and in the store's `actions`
table, the user's gradients are handed back, and the following steps update normally.
`raise`: `NanguardError` whose `.report` is `failed` with the first non-finite value at step K,
and report.json is on disk.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import nanguard
from helpers import make_mlp, make_optimizer
from nanguard import Guard
from nanguard.record.store import open_run

K = 12
STEPS = 20


def _snapshot(model, optimizer):
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(optimizer.state_dict()["state"]),
    )


def _same(a, b) -> bool:
    (params_a, state_a), (params_b, state_b) = a, b
    if not all(torch.equal(p, q) for p, q in zip(params_a, params_b, strict=True)):
        return False
    if state_a.keys() != state_b.keys():
        return False
    return all(
        torch.equal(torch.as_tensor(state_a[i][k]), torch.as_tensor(state_b[i][k]))
        for i in state_a
        for k in state_a[i]
    )


def _poisoned(batches):
    for step, (x, y) in enumerate(batches):
        if step == K:
            x = x.clone()
            x[3, 5] = math.nan
        yield x, y


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_skip_discards_the_poisoned_update(kind, tmp_path, quiet_config):
    task = make_mlp(0)
    optimizer = make_optimizer(kind, task.model, 1e-2)
    guard = Guard(task.model, optimizer, config=quiet_config(out=str(tmp_path), policy="skip"))
    before_after = []
    for x, y in _poisoned(task.batches(STEPS)):
        loss = task.loss_fn(task.model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        grads = [p.grad for p in task.model.parameters()]
        before = _snapshot(task.model, optimizer)
        optimizer.step()
        after = _snapshot(task.model, optimizer)
        # The guard hands the user's gradients back after discarding the update.
        assert all(p.grad is g for p, g in zip(task.model.parameters(), grads, strict=True))
        before_after.append((before, after))
    report = guard.close()

    for step, (before, after) in enumerate(before_after):
        if step == K:
            assert _same(before, after), "skip changed parameters or optimizer state"
        else:
            assert not _same(before, after), f"step {step} did not update"
    assert all(torch.isfinite(p).all() for p in task.model.parameters())
    if kind == "adam":
        # Step counters skipped exactly one step.
        assert all(float(s["step"]) == STEPS - 1 for s in optimizer.state.values())
    else:
        assert all("momentum_buffer" in s for s in optimizer.state.values())

    assert [(a["step"], a["action"]) for a in report.actions] == [(K, "skip")]
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == K
    assert report.first_nonfinite["phase"] == "data"
    assert report.first_nonfinite["samples"] == [3]
    assert report.status == "recovered"
    assert report.steps == STEPS
    db = open_run(tmp_path)
    try:
        assert db.execute("SELECT step, action FROM actions").fetchall() == [(K, "skip")]
        skipped = db.execute("SELECT step FROM steps WHERE skipped = 1").fetchall()
        assert skipped == [(K,)]
        assert db.execute("SELECT count(*) FROM steps").fetchone()[0] == STEPS
    finally:
        db.close()


def test_raise_stops_with_the_report(tmp_path, quiet_config):
    task = make_mlp(0)
    optimizer = make_optimizer("adam", task.model, 1e-2)
    guard = Guard(task.model, optimizer, config=quiet_config(out=str(tmp_path), policy="raise"))
    completed = 0
    with pytest.raises(nanguard.NanguardError) as info:
        for x, y in _poisoned(task.batches(STEPS)):
            loss = task.loss_fn(task.model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            optimizer.zero_grad()
            loss.backward()
            before = _snapshot(task.model, optimizer)
            optimizer.step()
            completed += 1
    assert completed == K
    # Stopped before the update: the poisoned step changed nothing.
    assert _same(before, _snapshot(task.model, optimizer))
    report = info.value.report
    assert report.status == "failed"
    assert report.first_nonfinite["step"] == K
    assert report.steps == K
    assert [a["action"] for a in report.actions] == ["raise"]
    assert f"step {K}" in str(info.value)

    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["status"] == "failed"
    assert on_disk["first_nonfinite"]["step"] == K
    # The guard closed itself: its hooks are gone and training without it works.
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    optimizer.zero_grad()
    task.loss_fn(task.model(torch.randn(4, 16)), torch.randn(4, 1)).backward()
    optimizer.step()
