"""The quiet gate on real training: report.json and run.db are the same with it on and off.

Each run trains a tiny CPU model twice from the same seed under a guard, once with the gate
(the default) and once with `DetectConfig(quiet_gate=False)` (every step through every
detector), and compares everything the run leaves behind except what differs between any two
runs: the folder, the wall-clock time of each step row, and the process/start metadata.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import torch

import nanguard
from helpers import make_mlp, train, warmup_cosine
from nanguard import DetectConfig, GuardConfig, RecordConfig, WatchConfig
from nanguard.detect.gate import QuietGate
from nanguard.errors import NanguardError
from nanguard.scenarios.cascade import train_cascade

_VOLATILE_META = {"process", "started", "start", "time"}


def passes_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the steps (phases) the quiet gate takes from here on: `[count]`."""
    took = [0]
    passes = QuietGate.passes

    def counting(self: QuietGate, *args: Any) -> bool:
        passed = passes(self, *args)
        took[0] += passed
        return passed

    monkeypatch.setattr(QuietGate, "passes", counting)
    return took


def _leftovers(out: Path) -> tuple[Any, dict[str, list[Any]]]:
    report = json.loads((out / "report.json").read_text())
    report["run"].pop("folder", None)
    heal = (report["run"].get("recovery") or {}).get("heal")
    if isinstance(heal, dict):  # wall time spent healing, where reported: differs every run
        heal.pop("seconds", None)
    db = sqlite3.connect(out / "run.db")
    tables: dict[str, list[Any]] = {}
    names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    for name in names:
        cur = db.execute(f"SELECT * FROM {name}")  # noqa: S608 - names from the file itself
        cols = [c[0] for c in cur.description]
        rows = [tuple(v for c, v in zip(cols, row, strict=True) if c != "time")
                for row in cur.fetchall()]
        if name == "meta":
            rows = [r for r in rows if r[0] not in _VOLATILE_META]
        # NaN != NaN: compare rows by their repr.
        tables[name] = [repr(r) for r in rows]
    db.close()
    return report, tables


def _config(out: Path, policy: str, gate: bool = True, **watch: Any) -> GuardConfig:
    return GuardConfig(policy=policy, record=RecordConfig(out=str(out), summary=False),
                       watch=WatchConfig(**watch), detect=DetectConfig(quiet_gate=gate))


def _cascade(out: Path, gate: bool, seed: int, policy: str, **kw: Any) -> nanguard.Guard:
    made: list[nanguard.Guard] = []

    def factory(model: torch.nn.Module, opt: torch.optim.Optimizer) -> nanguard.Guard:
        g = nanguard.Guard(model, opt, config=_config(out, policy, gate))
        made.append(g)
        return g

    with contextlib.suppress(NanguardError):  # `raise`: the report is written all the same
        train_cascade(seed, factory, **kw)
    return made[0]


def _healthy(out: Path, gate: bool, seed: int, policy: str, **kw: Any) -> nanguard.Guard:
    task = make_mlp(seed)
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    sched = warmup_cosine(opt, kw.get("steps", 150), warmup=20)
    g = nanguard.Guard(task.model, opt,
                       config=_config(out, policy, gate, activations=True, activations_every=3))
    train(task, opt, kw.get("steps", 150), guard=g, scheduler=sched)
    g.close()
    return g


CASES = [
    ("cascade-8-observe", _cascade, 8, "observe", {"steps": 200}),
    ("cascade-8-skip", _cascade, 8, "skip", {"steps": 200}),
    ("cascade-8-rollback", _cascade, 8, "rollback", {"steps": 200}),
    ("cascade-early-raise", _cascade, 3, "raise", {"steps": 120, "outlier_at": 12}),
    ("healthy-mlp-observe", _healthy, 1, "observe", {"steps": 150}),
    ("healthy-mlp-skip", _healthy, 2, "skip", {"steps": 150}),
]


@pytest.mark.parametrize("name,run,seed,policy,kw", CASES, ids=[c[0] for c in CASES])
def test_same_report_and_store_with_gate_on_and_off(
    tmp_path: Path, name: str, run: Any, seed: int, policy: str, kw: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    took = passes_counter(monkeypatch)
    on = run(tmp_path / "on", True, seed, policy, **kw)
    passed_on, took[0] = took[0], 0
    off = run(tmp_path / "off", False, seed, policy, **kw)
    assert took[0] == 0
    assert passed_on > 10  # the gate took steps: the comparison is not vacuous
    assert_same_runs(on, off, tmp_path / "on", tmp_path / "off")
    if name.startswith("cascade"):
        assert on.alarms, "the cascade raises alarms: both paths must see them"


def assert_same_runs(on: nanguard.Guard, off: nanguard.Guard, out_on: Path, out_off: Path
                     ) -> None:
    """Two runs of one training, under two paths of the guard, left the same report.json,
    run.db, detector state and alarms (also used by tests/test_quiet_lane.py)."""
    rep_on, db_on = _leftovers(out_on)
    rep_off, db_off = _leftovers(out_off)
    assert json.dumps(rep_on, sort_keys=True) == json.dumps(rep_off, sort_keys=True)
    assert db_on == db_off
    assert json.dumps([d.state_dict() for d in on.detectors]) == json.dumps(
        [d.state_dict() for d in off.detectors])
    assert json.dumps([a.to_dict() for a in on.alarms]) == json.dumps(
        [a.to_dict() for a in off.alarms])
