"""`nanguard run` gives the same finding as the Guard API / op checker on the scenario suite:
each scenario, run as an unmodified script, ends with report.json naming the expected phase,
module and op (from the in-process replay of the failing step, or the deterministic re-run with
the checker armed when that step cannot be replayed in process) and the expected cause.

`nanguard run` runs in this process (`nanguard_here`): what is read is its exit code, output
and record, no process boundary; the command's process is tested in test_run_script.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from _run import ROOT, nanguard_here, report

from scenarios import SCENARIOS, load

SCRIPT = ROOT / "tests" / "integrations" / "scenario_script.py"


@pytest.mark.parametrize("name", SCENARIOS)
def test_nanguard_run_names_the_scenarios_origin(tmp_path: Path, name: str) -> None:
    expected = load(name).EXPECTED
    out = tmp_path / name
    r = nanguard_here(out, SCRIPT, name)
    if r.stdout.startswith("skip:"):
        pytest.skip(r.stdout.strip())
    assert r.returncode == 1, r.stderr  # training failed
    rep = report(out)
    first = rep["first_nonfinite"]
    assert first is not None, rep
    assert rep["run"]["replay"]["status"] in ("in-process", "found"), rep["run"]["replay"]
    assert (first["phase"], first["module"], first["op"]) == (
        expected["phase"],
        expected["module"],
        expected["op"],
    ), first
    if expected.get("samples") is not None:
        assert first["samples"] == expected["samples"]
    if name != "cascade":  # the cascade's cause needs its alarms: a single step has none
        assert rep["diagnosis"][0]["cause"] == expected["cause"], rep["diagnosis"]
