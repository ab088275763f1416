"""The record: the run store and report.json (DESIGN.md sections 2.6 and 3).

NaN points survive (a NaN loss reads back as NaN, not NULL, not dropped); report.json has the
documented keys with NaN written as strings (strict JSON); per-parameter statistics and per-sample
batch fingerprints are stored (same batch, same fingerprint; one changed sample, a different one
for that sample only); `close()` removes every hook it added, is idempotent, and the
context-manager form closes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import make_mlp, make_optimizer
from nanguard import Guard, load_report
from nanguard.record.store import dec, open_run

K = 6


def _poisoned_run(tmp_path, quiet_config, steps: int = 10):
    task = make_mlp(0)
    optimizer = make_optimizer("adam", task.model, 1e-3)
    guard = Guard(task.model, optimizer, config=quiet_config(out=str(tmp_path), activations=True))
    for step, (x, y) in enumerate(task.batches(steps)):
        if step == K:
            x = x.clone()
            x[2, 0] = math.nan
        loss = task.loss_fn(task.model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        if step == K:
            for p in task.model.parameters():  # keep the run alive after the poisoned step
                p.grad = torch.nan_to_num(p.grad, nan=0.0)
        optimizer.step()
    return task, guard, guard.close()


def test_store_keeps_nan_points(tmp_path, quiet_config):
    task, guard, report = _poisoned_run(tmp_path, quiet_config)
    db = open_run(tmp_path)
    try:
        rows = db.execute("SELECT step, loss FROM steps ORDER BY step").fetchall()
        assert [s for s, _ in rows] == list(range(10)), "a step was dropped"
        losses = {s: dec(v) for s, v in rows}
        assert rows[K][1] is not None, "NaN stored as NULL"
        assert math.isnan(losses[K])
        assert all(math.isfinite(v) for s, v in losses.items() if s != K)
        acts = db.execute("SELECT absmax FROM activations WHERE step = ?", (K,)).fetchall()
        assert acts and any(v is not None and math.isnan(dec(v)) for (v,) in acts)
        alarm_values = db.execute("SELECT value FROM alarms WHERE kind = 'nonfinite'").fetchall()
        assert alarm_values and all(math.isnan(dec(v)) for (v,) in alarm_values)
        nonfinite = json.loads(
            db.execute("SELECT nonfinite FROM steps WHERE step = ?", (K,)).fetchone()[0]
        )
        assert "loss" in nonfinite
    finally:
        db.close()


def test_report_json_keys_and_nan_as_strings(tmp_path, quiet_config):
    _, _, report = _poisoned_run(tmp_path, quiet_config)

    def no_bare_nan(token):
        raise AssertionError(f"bare {token} in report.json (not strict JSON)")

    data = json.loads((tmp_path / "report.json").read_text(), parse_constant=no_bare_nan)
    documented = {"status", "steps", "alarms", "first_nonfinite", "diagnosis", "actions"}
    assert documented <= set(data)
    assert data["status"] == "failed" and data["steps"] == 10
    assert data["first_nonfinite"]["step"] == K
    assert data["first_nonfinite"]["phase"] == "data"
    assert data["first_nonfinite"]["samples"] == [2]
    assert set(data["first_nonfinite"]) >= {"step", "phase", "module", "op", "source", "samples"}
    for alarm in data["alarms"]:
        assert set(alarm) >= {"step", "kind", "signal", "value", "message"}
    nonfinite = [a for a in data["alarms"] if a["kind"] == "nonfinite"]
    assert nonfinite and all(a["value"] == "nan" for a in nonfinite)
    assert isinstance(data["diagnosis"], list) and isinstance(data["actions"], list)
    # load_report reads the same thing back.
    again = load_report(tmp_path)
    assert again.status == "failed" and again.first_nonfinite["step"] == K


def test_per_parameter_stats_are_stored(tmp_path, quiet_config):
    task, _, _ = _poisoned_run(tmp_path, quiet_config)
    names = [n for n, _ in task.model.named_parameters()]
    db = open_run(tmp_path)
    try:
        assert [n for (n,) in db.execute("SELECT name FROM params ORDER BY id")] == names
        rows = db.execute(
            "SELECT step, param_id, grad_norm, param_norm, state FROM param_stats "
            "WHERE step = 0 ORDER BY param_id"
        ).fetchall()
        assert [r[1] for r in rows] == list(range(len(names)))
        for _, _pid, g, p, state in rows:
            assert dec(g) > 0 and dec(p) > 0
            assert set(json.loads(state)) == {"exp_avg", "exp_avg_sq"}
        count = db.execute("SELECT count(*) FROM param_stats").fetchone()[0]
        assert count == 10 * len(names)
        # The last step's parameter norms match the model.
        last = db.execute(
            "SELECT param_norm FROM param_stats WHERE step = 9 ORDER BY param_id"
        ).fetchall()
        for (v,), (_, p) in zip(last, task.model.named_parameters(), strict=True):
            assert math.isclose(dec(v), float(p.detach().norm()), rel_tol=1e-5)
    finally:
        db.close()


def test_batch_fingerprints(tmp_path, quiet_config):
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = Guard(model, optimizer, config=quiet_config(out=str(tmp_path)))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)
    x_changed = x.clone()
    x_changed[3, 7] += 1e-3  # one element of one sample
    y_changed = y.clone()
    y_changed[1, 0] = -y_changed[1, 0]  # one label
    for bx, by in [(x, y), (x.clone(), y.clone()), (x_changed, y), (x, y_changed)]:
        loss = nn.functional.mse_loss(model(bx), by)
        guard.watch(loss=loss, batch=(bx, by))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    guard.close()
    db = open_run(tmp_path)
    try:
        rows = db.execute("SELECT fingerprint, samples FROM batches ORDER BY step").fetchall()
    finally:
        db.close()
    assert len(rows) == 4
    fps = [fp for fp, _ in rows]
    samples = [json.loads(s) for _, s in rows]
    assert fps[0] == fps[1] and samples[0] == samples[1]  # same bytes, same fingerprint
    assert len(set(samples[0])) == 5  # samples tell apart
    assert fps[2] != fps[0] and fps[3] != fps[0] and fps[2] != fps[3]
    assert [i for i in range(5) if samples[2][i] != samples[0][i]] == [3]
    assert [i for i in range(5) if samples[3][i] != samples[0][i]] == [1]


def _hook_counts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, ...]:
    return (
        len(optimizer._optimizer_step_pre_hooks),
        len(optimizer._optimizer_step_post_hooks),
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        sum(len(m._backward_hooks) for m in model.modules()),
    )


def test_close_removes_every_hook_and_is_idempotent(tmp_path, quiet_config):
    task = make_mlp(0)
    optimizer = make_optimizer("sgd", task.model, 0.01)
    # A user's own hooks stay.
    task.model[0].register_forward_hook(lambda *a: None)
    optimizer.register_step_post_hook(lambda *a: None)
    before = _hook_counts(task.model, optimizer)
    guard = Guard(task.model, optimizer, config=quiet_config(out=str(tmp_path), activations=True))
    during = _hook_counts(task.model, optimizer)
    assert during[0] > before[0] and during[2] > before[2]
    x, y = next(task.batches(1))
    loss = task.loss_fn(task.model(x), y)
    loss.backward()
    optimizer.step()
    report = guard.close()
    assert _hook_counts(task.model, optimizer) == before
    assert guard.close() is report  # idempotent
    assert _hook_counts(task.model, optimizer) == before
    assert report.steps == 1
    # Training after close goes on without the guard (nothing recorded, nothing raised).
    optimizer.step()
    assert load_report(tmp_path).steps == 1


def test_context_manager_closes(tmp_path, quiet_config):
    task = make_mlp(0)
    optimizer = make_optimizer("adam", task.model, 1e-3)
    before = _hook_counts(task.model, optimizer)
    with Guard(
        task.model, optimizer, config=quiet_config(out=str(tmp_path), activations=True)
    ) as g:
        for x, y in task.batches(3):
            loss = task.loss_fn(task.model(x), y)
            g.watch(loss=loss, batch=(x, y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert _hook_counts(task.model, optimizer) == before
    assert g.report is not None and g.report.status == "healthy"
    assert json.loads((tmp_path / "report.json").read_text())["steps"] == 3


def test_a_report_rebuilt_from_the_store_is_diagnosed(tmp_path: Path) -> None:
    """The process died before its report (report.json removed here): the stored finding (a
    NaN row of the batch, its phase and samples) is explained as at close, not left
    `undetermined`."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = Guard(model, opt, out=tmp_path / "run")
    for step in range(4):
        x = torch.randn(8, 4)
        if step == 2:
            x[5, 1] = float("nan")
        loss = model(x).pow(2).mean()
        g.watch(loss=loss, batch=(x,))
        opt.zero_grad()
        loss.backward()
        opt.step()
    closed = g.close()
    assert closed.diagnosis[0]["cause"] == "data_nonfinite"
    (tmp_path / "run" / "report.json").unlink()
    db = open_run(tmp_path / "run")
    with db:  # the process that wrote it is gone (a pid that no process has)
        db.execute("UPDATE meta SET value = ? WHERE key = 'process'",
                   (json.dumps({"pid": 2**22 + 12345, "host": None}),))
    db.close()
    rebuilt = load_report(tmp_path / "run")
    assert rebuilt.status == "failed" and rebuilt.first_nonfinite["samples"] == [5]
    assert rebuilt.diagnosis[0]["cause"] == "data_nonfinite", rebuilt.diagnosis


@pytest.mark.parametrize("action", ["heal_clip", "lr_cut", "wd_cut", "lr_ramp"])
def test_a_run_heal_changed_is_never_healthy(action):
    # heal may clip or cut on a grad-norm jump below every alarm's threshold: the training was
    # changed, so the status says so even with no alarm and nothing non-finite.
    from nanguard.record.report import build_report

    actions = [{"step": 40, "action": action, "detail": "x"}]
    assert build_report(steps=100, alarms=[], actions=actions,
                        first_nonfinite=None).status == "recovered"
    assert build_report(steps=100, alarms=[], actions=[],
                        first_nonfinite=None).status == "healthy"
