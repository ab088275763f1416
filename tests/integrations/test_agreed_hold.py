"""`skip` acts for the cause under torch.distributed too (issue 40 items 2 and 4;
`policy.recurrence`, `step.acting`): whether a spike's update goes ahead is agreed across ranks.

Two real gloo processes train a DDP MLP (`hold_worker.py`):
- an instability (the SGD LR ramps past the MLP's stability limit; the averaged gradient spikes
  on both ranks alike): its first spike is discarded, its later ones keep their updates on both
  ranks (main discarded every one under torch.distributed, 11 per rank here);
- two bad batches on rank 1 alone, 10 steps apart: rank 1 traces each to its batch, rank 0
  sees only the averaged gradient's spike, and would keep the second (a recurrence by its own
  evidence). Rank 1's verdict wins: both ranks discard both updates.
In both, the replicas end bit for bit equal.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _run import env, free_port

WORKER = Path(__file__).resolve().parent / "hold_worker.py"


def _run(tmp_path: Path, scenario: str) -> list[dict]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(tmp_path), str(rank), port,
                               scenario], env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            line = next((s for s in stdout.splitlines() if s.startswith("RESULT ")), None)
            assert line is not None, stderr[-3000:]
            results.append(json.loads(line.removeprefix("RESULT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # this test's own child, by its pid
    return results


def test_an_instability_keeps_its_updates_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, "ramp")
    assert r0["params"] == r1["params"]  # the replicas stayed together
    assert r0["spikes"] == r1["spikes"] and len(r0["spikes"]) >= 3, r0
    for r in (r0, r1):
        assert r["skips"] == [r0["spikes"][0]], r  # the first spike, lone so far
        assert len(r["held"]) == 1 and r["held"][0] in r0["spikes"][1:], r
        assert "none traced to a batch" in r["details"][str(r["held"][0])]


def test_one_ranks_bad_batch_is_discarded_on_every_rank(tmp_path: Path) -> None:
    r0, r1 = _run(tmp_path, "bad")
    assert r0["params"] == r1["params"]
    assert r1["bad"] == [60, 70], r1  # rank 1 traced both to its batches
    assert r0["bad"] == [] and r0["spikes"] == [60, 70], r0  # rank 0: the averaged gradient
    assert r0["skips"] == r1["skips"] == [60, 70]
    assert r0["held"] == r1["held"] == []
    # Rank 0 would have kept the second (a spike 10 steps after an untraced one).
    assert "discarded with the other ranks" in r0["details"]["70"]
