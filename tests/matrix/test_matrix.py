"""Configuration matrix: nanguard is correct in every ordinary training setup.

Each cell is (setup x case), see `matrix_rigs`. A cell passes when, under the `observe` policy:

- healthy: every guard reports `healthy` with no alarm and no non-finite value, and the trained
  parameters are bitwise identical to the same run without nanguard (and finite, and moved
  away from their initial values, so that the comparison can fail);
- nan_row: the first non-finite finding is at the bad step, phase `data`, naming the bad row, and
  the top diagnosis is `data_nonfinite`;
- sqrt0: the first non-finite finding is at the bad step, phase `backward`, in the module that
  holds the sqrt, and the top diagnosis is `singular_gradient` (the guards have `replay=`);

and in every case: no record is lost (each guard's run folder is its own, report.json's `steps`
is the number of optimizer steps that ran, and run.db holds every one of them), no guard claims a
finding before the bad step, an unrelated run in the same process stays healthy, a run after the
guarded one computes the same numbers as before it (no global side effect, e.g. on
torch.compile's caches), and parameters match the unguarded run (NaN where it has NaN).

A setup nanguard does not support must be refused at `Guard(...)` with a one-line ValueError:
such setups are listed in REFUSED with a fragment of the message, and their cells assert the
refusal instead.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch
from matrix_rigs import ROW, SETUPS, Result, Setup, run, run_without_bad

REFUSED: dict[str, str] = {}
"""Setup name -> fragment of the ValueError message `Guard(...)` refuses it with."""

CELLS = [pytest.param(s, c, id=f"{s.name}-{c}") for s in SETUPS for c in s.cases]


def _db_steps(folder: Path) -> int:
    con = sqlite3.connect(folder / "run.db")
    try:
        return int(con.execute("SELECT count(*) FROM steps").fetchone()[0])
    finally:
        con.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if torch.equal(a, b):
        return True
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b])


def _check_records(res: Result) -> None:
    assert res.reports and all(r is not None for r in res.reports)
    assert len({str(f) for f in res.folders}) == len(res.folders), (
        f"guards share a run folder: {res.folders}")
    for report, folder, taken in zip(res.reports, res.folders, res.steps_taken, strict=True):
        assert folder is not None and (folder / "report.json").is_file(), folder
        assert report.steps == taken, f"{folder}: report.steps {report.steps}, ran {taken}"
        assert _db_steps(folder) == taken, f"{folder}: run.db lost steps"


def _check_params(guarded: Result, plain: Result, case: str) -> None:
    assert guarded.params.keys() == plain.params.keys()
    for name, p in guarded.params.items():
        assert p.dtype == plain.params[name].dtype, name
        assert _same(p, plain.params[name]), f"{name} differs from the run without nanguard"
        if case != "healthy":
            continue
        # The comparison above could fail: the parameters are finite and were trained.
        assert bool(torch.isfinite(p).all()), name
        if name in guarded.trainable:
            assert not torch.equal(p, guarded.init[name].to(p.dtype)), f"{name} never changed"
        else:
            assert torch.equal(p, guarded.init[name].to(p.dtype)), f"frozen {name} changed"


def _check_finding(res: Result, case: str) -> None:
    for i in res.healthy_reports:
        r = res.reports[i]
        assert r.status == "healthy" and r.first_nonfinite is None, (
            f"an unrelated run got {r.status}: {r.first_nonfinite}")
    # Steps are each optimizer's own (a GradScaler may have skipped some): compare each
    # guard's finding with the step its optimizer was at when the bad batch came.
    found = [(r.first_nonfinite["step"] - res.bad_steps[i], i, r)
             for i, r in enumerate(res.reports) if r.first_nonfinite is not None]
    assert found, f"no guard found the non-finite value: {[r.status for r in res.reports]}"
    for late, i, r in found:
        assert late >= 0, f"guard {i} claims a non-finite value before the bad batch: {r}"
    late, _, report = min(found, key=lambda t: (t[0], t[1]))
    first = report.first_nonfinite
    assert report.status != "healthy"
    assert late == 0, f"found {late} step(s) after the bad batch: {first}"
    causes = [d["cause"] for d in report.diagnosis]
    if case == "nan_row":
        assert first["phase"] == "data", first
        assert first["samples"] == [ROW], first
        assert causes[:1] == ["data_nonfinite"], causes
    else:
        assert first["phase"] == "backward", first
        assert str(first["module"]).replace("_orig_mod.", "") == res.expect_module, first
        assert causes[:1] == ["singular_gradient"], causes


@pytest.mark.parametrize(("setup", "case"), CELLS)
def test_cell(setup: Setup, case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # default run folders (several_guards) land here
    if setup.name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[setup.name]) as info:
            run(setup, case, tmp_path / "runs")
        assert "\n" not in str(info.value)
        return
    before = run_without_bad(setup, case)
    guarded = run(setup, case, tmp_path / "runs")
    plain = run(setup, case, None)
    after = run_without_bad(setup, case)
    if before is not None and after is not None:
        # Nothing global changed: a run after nanguard's computes what it did before (finite
        # parameters: the run without the bad batch).
        for name, p in before.params.items():
            assert torch.equal(p, after.params[name]), (
                f"{name}: the same run gives other numbers after a guarded run")
    _check_records(guarded)
    if case == "healthy":
        for r in guarded.reports:
            assert r.status == "healthy", (r.status, r.alarms, r.first_nonfinite)
            assert r.alarms == [] and r.first_nonfinite is None
    else:
        _check_finding(guarded, case)
    _check_params(guarded, plain, case)


ROLLBACK_CELLS = [pytest.param(s, c, id=f"{s.name}-{c}") for s in SETUPS for c in s.cases
                  if c != "healthy"]


@pytest.mark.parametrize(("setup", "case"), ROLLBACK_CELLS)
def test_rollback_cell(setup: Setup, case: str, tmp_path: Path,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same setups under `rollback` (snapshot every step, no LR backoff): the bad step is
    rolled back by the guard that sees it (and by every other rolling-back guard of the same
    model), training ends with finite parameters bitwise equal to the run that never saw the
    bad batch, nothing stands down, every record is kept, an unrelated run is untouched.
    With a GradScaler, the scaler has already skipped the bad step's update: the guard records
    it and leaves the next (good) steps alone."""
    monkeypatch.chdir(tmp_path)
    if setup.name in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[setup.name]):
            run(setup, case, tmp_path / "runs", "rollback")
        return
    res = run(setup, case, tmp_path / "runs", "rollback")
    _check_records(res)
    for name, p in res.params.items():
        assert bool(torch.isfinite(p).all()), f"{name} not finite after rollback"
    rolled = []
    for i, r in enumerate(res.reports):
        assert r.status in ("healthy", "recovered"), (i, r.status, r.run.get("error"))
        acts = [(a["step"], a["action"]) for a in r.actions if a["action"] != "amp_skip"]
        if i in res.healthy_reports:
            assert acts == [] and r.status == "healthy", (i, acts)
            continue
        if setup.amp == "fp16":
            assert acts == [], f"the scaler skipped the bad step already; the guard did {acts}"
            assert r.first_nonfinite is not None and r.status == "recovered", r
            continue
        assert acts in ([], [(res.bad_steps[i], "rollback")]), (i, acts)
        if acts:  # its updates were discarded and restored: not a healthy run
            assert r.status == "recovered", (i, r.status)
        rolled += acts
    assert rolled or setup.amp == "fp16", "no guard rolled back the bad step"
    ref = run_without_bad(setup, case)
    if ref is not None:  # restored bit for bit: as if the bad batch had never come
        for name, p in res.params.items():
            assert p.dtype == ref.params[name].dtype and torch.equal(p, ref.params[name]), (
                f"{name} differs from the run that never saw the bad batch")
