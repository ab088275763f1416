"""Smoke test of benchmarks/cold_ops.py: a few rounds end to end, every probe timed, the last
line the JSON summary; a bad `--rounds` is a one-line error. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark's smoke test: left out of the default run, CI runs it (-m bench).
pytestmark = pytest.mark.bench

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cold_ops.py"


def test_cold_ops_runs_and_prints_json(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["us"]) == {"noop", "sum_item", "mv_int32", "sum_then_mv", "sum_twice",
                                 "warm_sum_item"}
    assert all(v > 0 for v in result["us"].values()) and result["rounds"] == 2
    bad = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "0"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rounds must be >= 1" in bad.stderr
    assert "Traceback" not in bad.stderr
