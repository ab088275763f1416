"""Lightning adapter under DDP: two CPU processes (gloo, strategy="ddp", launched as torchrun
launches them), a NaN row on rank 1 only. Both ranks skip the same step (the decision is agreed
across ranks), their parameters stay finite and equal, each rank records into OUT/rank-R/ and
rank 0 writes the merged report."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

from lightning_rig import BATCH  # noqa: E402

from helpers import child_env  # noqa: E402

WORKER = Path(__file__).with_name("ddp_worker.py")

STEPS, BAD_STEP, BAD_ROW = 16, 6, 2


def test_ddp_both_ranks_skip_the_same_step(tmp_path):
    bad_index = BAD_STEP * BATCH + BAD_ROW  # in rank 1's data only
    out = tmp_path / "run"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = child_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                        LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank),
                        PYTHONWARNINGS="ignore")
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), str(out), str(bad_index), str(STEPS)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-3000:]
    results = [next(line for line in text.splitlines() if line.startswith("RESULT"))
               for text in outputs]
    assert all("finite=True" in r for r in results)
    assert results[0].split("checksum=")[1] == results[1].split("checksum=")[1]  # in sync
    reports = [json.loads((out / f"rank-{r}" / "report.json").read_text()) for r in (0, 1)]
    for report in reports:
        assert [(a["step"], a["action"]) for a in report["actions"]] == [(BAD_STEP, "skip")]
        assert report["steps"] == STEPS
        assert report["first_nonfinite"]["step"] == BAD_STEP
    assert reports[1]["first_nonfinite"]["phase"] == "data"
    assert BAD_ROW in reports[1]["first_nonfinite"]["samples"]
    merged = json.loads((out / "report.json").read_text())
    assert merged["first_nonfinite"]["rank"] == 1
    assert merged["first_nonfinite"]["phase"] == "data"
    assert merged["status"] == reports[0]["status"]
