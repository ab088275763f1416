"""The run log records each action in one place (list, run.db, event agree); recovery and the
policy stage return effects instead of calling the guard; the finding is one typed object."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.record.events import Event
from nanguard.record.finding import Finding
from nanguard.record.store import open_run
from nanguard.recover.effects import Discard, Record

BAD = (3, 4)  # steps whose batch holds a NaN row


def _run(tmp_path: Path, policy: str, steps: int = 8) -> tuple[Guard, nn.Module, list[Event]]:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: list[Event] = []
    guard = Guard(model, opt, policy=policy, out=tmp_path / policy, on_action=seen.append,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    for k in range(steps):
        x = torch.randn(8, 4)
        if k in BAD:
            x[5, 2] = math.nan
        loss = model(x).pow(2).mean()
        guard.watch(loss=loss, batch=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return guard, model, seen


def test_each_action_is_in_the_list_run_db_and_an_event_alike(tmp_path: Path) -> None:
    guard, model, seen = _run(tmp_path, "skip")
    report = guard.close()
    # Independently of nanguard: the skipped steps are the two with a NaN row, and the
    # weights stayed finite because their updates never landed.
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [a["step"] for a in guard.actions] == list(BAD)
    assert all(a["action"] == "skip" for a in guard.actions)
    assert report.actions == guard.actions
    assert [e.data for e in seen] == guard.actions
    db = open_run(tmp_path / "skip")
    rows = [{"step": s, "action": a, "detail": d}
            for s, a, d in db.execute("SELECT * FROM actions ORDER BY step, rowid")]
    db.close()
    assert rows == guard.actions


def test_the_finding_is_typed_and_the_guards_dict_is_a_copy(tmp_path: Path) -> None:
    guard, _, _ = _run(tmp_path, "observe", steps=5)
    found = guard.first_nonfinite
    assert found is not None and found["step"] == BAD[0] and found["samples"] == [5]
    assert found["phase"] == "data"
    assert Finding.from_dict(found).to_dict() == found  # nothing lost, nothing added
    found["samples"] = [0]  # a caller's copy: the guard's finding does not change
    assert guard.first_nonfinite["samples"] == [5]  # type: ignore[index]
    report = guard.close()
    assert report.first_nonfinite is not None and report.first_nonfinite["samples"] == [5]
    on_disk = json.loads((tmp_path / "observe" / "report.json").read_text())
    assert on_disk["first_nonfinite"] == report.first_nonfinite


def test_a_findings_extra_keys_survive_the_round_trip() -> None:
    body = {"step": 2, "phase": "checkpoint", "module": "fc", "op": None, "source": "a.py:3",
            "samples": [], "rank": 0, "signals": ["param"], "param": "fc.weight",
            "tensors": ["fc.weight"], "load_sources": {"fc.weight": "a.py:3"}}
    f = Finding.from_dict(body)
    assert f.extra == {"tensors": ["fc.weight"], "load_sources": {"fc.weight": "a.py:3"}}
    assert f.to_dict() == body
    f.update({"verdict": "reproducible", "samples": [1]})
    assert f.get("verdict") == "reproducible" and f.samples == [1]


def test_recovery_returns_its_effects_instead_of_applying_them(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, policy="rollback", out=tmp_path / "rb",
                  config=GuardConfig(record=RecordConfig(summary=False)))
    start = [p.detach().clone() for p in model.parameters()]  # the first last-good state
    for _ in range(3):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert not all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    stats = guard.history[-1]
    effects = guard.recovery.rollback(stats, "a test", post=True)
    # Recovery restored the model itself and returned what the guard is to record.
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start, strict=True))
    records = [e for e in effects if isinstance(e, Record)]
    assert [r.action for r in records] == ["rollback"] and not any(
        isinstance(e, Discard) for e in effects)  # after the update: nothing to discard
    assert guard.actions == []  # returned, not applied
    guard.apply(effects)
    assert [a["action"] for a in guard.actions] == ["rollback"]
    assert guard.actions[0]["detail"] == records[0].detail
    report = guard.close()
    assert report.actions == guard.actions
