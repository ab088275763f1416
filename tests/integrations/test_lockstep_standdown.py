"""A monitor never breaks training, under torch.distributed too: when one rank's guard stands
down after an internal error while the policy agrees every step's decision across ranks, the
other ranks must not wait in an all-reduce it will never join. The rank that stands down says
so in the next agreement, and every rank stands down together (status `degraded` on each), and
training finishes on all of them. Two real gloo processes (DDP), the error injected on rank 0
before the pre-update agreement and before the post-update one; and under `observe` with a
replay, where the ranks agree before each update on a cross-rank re-run (`pinpoint.xrank`)
and the stand-down after it owes the next step's agreement, not a post-update one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _run import env, free_port

WORKER = Path(__file__).resolve().parent / "lockstep_worker.py"


@pytest.mark.parametrize(("where", "policy"),
                         [("pre", "skip"), ("post", "skip"), ("post", "observe")])
def test_one_rank_standing_down_stops_no_one(tmp_path: Path, where: str, policy: str) -> None:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(rank), port,
                               where, policy], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=90)
            assert p.returncode == 0, stderr[-3000:]
            line = next(s for s in stdout.splitlines() if s.startswith("RESULT "))
            results.append(json.loads(line.removeprefix("RESULT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # this test's own child, by its pid
    r0, r1 = results
    assert r0["steps"] == r1["steps"] == 10  # training finished on both ranks
    # (both results in the message: a failure here was seen once under CI load, unexplained)
    assert r0["status"] == r1["status"] == "degraded", results
    assert "injected internal error" in r0["error"]["error"]
    assert "rank 0" in r1["error"]["error"]  # rank 1 says why it stood down with rank 0
