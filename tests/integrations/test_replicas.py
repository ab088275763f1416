"""Replica agreement with 2 real gloo processes (DDP): a bit flipped on rank 1's parameters
alone, too small for any numeric detector, is a `replica_divergence` alarm on both ranks at the
first check after it, naming rank 1 and the tensor; the checks before it are silent, and the
same divergence is not repeated at the next check. When rank 0's guard stands down early (an
internal error), the ranks stay in lockstep: nothing hangs and rank 1 still names itself; when
rank 1 has no Guard at all, rank 0's check turns itself off instead of waiting for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _run import env, free_port

WORKER = Path(__file__).resolve().parent / "replica_worker.py"


def _launch(tmp_path: Path, mode: str) -> tuple[list[dict], list[str]]:
    """Both ranks' RESULT dicts and their stderr."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path), str(rank), port, mode],
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    results, errs = [], []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            line = next(s for s in stdout.splitlines() if s.startswith("RESULT "))
            results.append(json.loads(line.removeprefix("RESULT ")))
            errs.append(stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by this test's own child's pid
    return results, errs


@pytest.mark.parametrize("mode", ["plain", "standdown"])
def test_flip_on_rank_1_is_named(tmp_path: Path, mode: str) -> None:
    results, _ = _launch(tmp_path, mode)
    r0, r1 = results
    assert not r0["flip"]["fired"] and r1["flip"]["fired"]  # rank 1 only
    assert abs(r1["flip"]["new"] - r1["flip"]["old"]) < 1e-6  # the lowest mantissa bit
    # Before the first update, after steps 0 (the first), 3, 7 and 11.
    assert r0["checks"] == r1["checks"] == 5
    if mode == "standdown":  # rank 0 took part in every check but records nothing
        assert r0["alarms"] == [] and r0["error"] is not None
        results = [r1]
    for res in results:
        # Nothing else fires: the flip is invisible to every numeric detector.
        assert [(a["step"], a["kind"]) for a in res["alarms"]] == [(7, "replica_divergence")]
        msg = res["alarms"][0]["message"]
        assert "rank 1 in module.0.weight (reference: rank(s) 0)" in msg, msg
        assert res["causes"][0] == "replica_divergence"  # the report's diagnosis names it


@pytest.mark.parametrize("policy", ["skip", "rollback", "raise"])
def test_under_an_acting_policy_the_check_rides_the_agreement(tmp_path: Path,
                                                              policy: str) -> None:
    """Under an acting policy every step's decision is agreed across ranks anyway: the due
    checks travel in that agreement (no all_gather of their own) and find the same flip
    (recorded, never acted on: no rank raises or rolls back for it)."""
    results, _ = _launch(tmp_path, f"plain-{policy}")
    for res in results:
        assert res["checks"] == 5 and res["rode"] == 4  # all but the one before any update
        assert [(a["step"], a["kind"]) for a in res["alarms"]] == [(7, "replica_divergence")]
        assert "rank 1 in module.0.weight (reference: rank(s) 0)" in res["alarms"][0]["message"]
        assert res["causes"][0] == "replica_divergence"


def test_riding_stops_with_the_lockstep(tmp_path: Path) -> None:
    """Rank 0's guard stands down at step 2; under `skip` rank 1's stands down with it in the
    next agreement, after which nothing agrees: the later checks take their own all_gather
    on both ranks alike (no hang, the same count), and record nothing (both stood down)."""
    results, _ = _launch(tmp_path, "standdown-skip")
    for res in results:
        assert res["error"] is not None and res["alarms"] == []
        assert res["checks"] == 5 and res["rode"] == 1  # after step 0 only


def test_a_flip_within_step_0_is_named_after_step_0(tmp_path: Path) -> None:
    """The check before the first update proves the start state; the one after step 0 then
    names a flip of step 0 (it used to read it as "not replicas" and turn itself off)."""
    results, errs = _launch(tmp_path, "step0")
    assert not results[0]["flip"]["fired"] and results[1]["flip"]["fired"]
    for res, err in zip(results, errs, strict=True):
        assert "replica check off" not in err, err[-2000:]
        assert res["checks"] == 5
        assert [(a["step"], a["kind"]) for a in res["alarms"]] == [(0, "replica_divergence")]
        msg = res["alarms"][0]["message"]
        assert "after step 0: rank 1 in module.0.weight (reference: rank(s) 0)" in msg, msg


def test_a_ddp_replica_changed_before_the_first_update_is_named(tmp_path: Path) -> None:
    """DDP broadcast the parameters when it was built: a rank that differs before any update
    is a fault there, not another kind of parallelism (no "check off")."""
    results, errs = _launch(tmp_path, "prestart")
    for res, err in zip(results, errs, strict=True):
        assert "replica check off" not in err, err[-2000:]
        assert [(a["step"], a["kind"]) for a in res["alarms"]] == [(0, "replica_divergence")]
        msg = res["alarms"][0]["message"]
        assert "before the update of step 0: rank 1 in module.0.weight" in msg, msg


def test_a_rank_without_guard_turns_the_check_off(tmp_path: Path) -> None:
    (r0, _), (err0, _) = _launch(tmp_path, "rank0only")
    # Read from the store before any collective: nothing waits for rank 1, nothing fires.
    assert r0["checks"] == 0 and r0["alarms"] == []
    assert "replica check off: rank(s) 1 have no Guard" in err0, err0[-2000:]


def test_a_rank_that_builds_its_guard_late_is_waited_for(tmp_path: Path) -> None:
    """Rank 1's guard is built inside its first step, after a pause (as `nanguard run` builds
    one at the first `optimizer.step()`): rank 0 reaches the check before the first update
    while rank 1 has not registered yet. It waits for it instead of turning its check off
    alone (which paired its next collective with rank 1's check: a hang, found in CI under
    load): both ranks check at every due step and find the flip, under `raise`."""
    results, _ = _launch(tmp_path, "late-raise")
    for res in results:
        assert res["checks"] == 5 and res["error"] is None
        assert [(a["step"], a["kind"]) for a in res["alarms"]] == [(7, "replica_divergence")]
