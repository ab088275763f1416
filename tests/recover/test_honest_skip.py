"""An honest skip (issue 40 item 4; `recover.skips`): a skipped update leaves the parameters,
Adam's moments and its step counter as they were, the LR schedule does not advance for it
(or the report says that it did), and each skip is counted and said live with its batch.

The reference is a run that never saw the bad batch: the same loop, which skips the batch's
`optimizer.step()` and `scheduler.step()` itself. Compared bit for bit with the run under
`skip` that did see it (a NaN in one row of the batch at step K): parameters, every optimizer
state tensor, `state['step']`, the scheduler's `last_epoch` and the LR.
"""

from __future__ import annotations

import json

import pytest
import torch
from recover_helpers import make_batches, make_model

from nanguard import Guard, GuardConfig, RecordConfig

K = 6
STEPS = 14


def _train(kind: str, *, guard: str | None, give_scheduler: bool = True, out=None):
    """Adam(W) with a per-step decaying schedule; step K's batch has a NaN in row 3. With
    `guard=None` the loop itself leaves batch K out (the reference)."""
    torch.manual_seed(0)
    model = make_model(0)
    cls = torch.optim.AdamW if kind.startswith("adamw") else torch.optim.Adam
    opt = cls(model.parameters(), lr=1e-2, fused=kind.endswith("fused") or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.2 * s))
    g = None
    if guard is not None:
        g = Guard(model, opt, scheduler=sched if give_scheduler else None, config=GuardConfig(
            policy=guard, record=RecordConfig(out=str(out) if out else "", summary=False)))
    for i, (x, y) in enumerate(make_batches(STEPS)):
        if i == K:
            if g is None:
                continue  # the reference never sees this batch
            x = x.clone()
            x[3, 0] = float("nan")
        loss = torch.nn.functional.mse_loss(model(x), y)
        if g is not None:
            g.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    report = g.close() if g is not None else None
    return model, opt, sched, report


def _same(a, b) -> None:
    ma, oa, sa, _ = a
    mb, ob, sb, _ = b
    for (n, p), q in zip(ma.named_parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q), n
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        s, t = oa.state[p], ob.state[q]
        assert s.keys() == t.keys()
        for key in s:
            assert torch.equal(torch.as_tensor(s[key]), torch.as_tensor(t[key])), key
    assert sa.last_epoch == sb.last_epoch
    assert [g["lr"] for g in oa.param_groups] == [g["lr"] for g in ob.param_groups]


@pytest.mark.parametrize("kind", ["adam", "adamw", "adam-fused"])
def test_a_skip_is_the_run_that_never_saw_the_batch(kind, tmp_path, caplog):
    caplog.set_level("WARNING", logger="nanguard")
    reference = _train(kind, guard=None)
    skipped = _train(kind, guard="skip", out=tmp_path)
    _same(skipped, reference)
    steps = {int(s["step"]) for s in skipped[1].state.values()}
    assert steps == {STEPS - 1}  # Adam's counter: one per update it really made
    report = json.loads((tmp_path / "report.json").read_text())
    skips = [a for a in report["actions"] if a["action"] == "skip"]
    assert [a["step"] for a in skips] == [K]
    assert "fingerprint(s) 0x" in skips[0]["detail"]
    assert "non-finite row(s) [3]" in skips[0]["detail"], skips[0]["detail"]
    held = report["run"]["recovery"]["skips"]
    assert held["count"] == 1 and held["steps"] == [K] and held["schedule_held"] == 1
    assert held["schedule_advanced"] == []
    said = [r.getMessage() for r in caplog.records]
    assert any(f"step {K}" in m and "skip" in m and "0x" in m for m in said), said


def test_a_scheduler_the_guard_was_not_given_is_reported_as_advanced(tmp_path):
    reference = _train("adam", guard=None)
    skipped = _train("adam", guard="skip", give_scheduler=False, out=tmp_path)
    # Parameters and moments as the reference had them one update ago...
    assert skipped[2].last_epoch == reference[2].last_epoch + 1  # ...but one schedule step ahead
    report = json.loads((tmp_path / "report.json").read_text())
    skips = report["run"]["recovery"]["skips"]
    assert skips["count"] == 1 and skips["schedule_held"] == 0
    assert skips["schedule_advanced"] == [K]
    assert "the LR moved after 1 skipped update(s)" in skips["note"]
    assert "scheduler=" in skips["note"]


def test_skip_ledger_state_round_trip():
    from nanguard.recover.skips import SkipLedger

    class _Opt:
        param_groups = [{"lr": 0.1}]

    a = SkipLedger(None, _Opt())
    a.skipped(3, 0.1)
    a.before_next(0.05)
    b = SkipLedger(None, _Opt())
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.steps, b.held, b.advanced) == ([3], 0, [3]) == (a.steps, a.held, a.advanced)
