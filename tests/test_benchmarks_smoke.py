"""Smoke test of benchmarks/overhead.py: it runs end to end and its last line is the JSON summary.

Tiny models and a couple of steps (`--quick`); no timing is asserted, only the output's shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark's smoke test: left out of the default run, CI runs it (-m bench).
pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[1]


def test_overhead_quick_prints_json_summary(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--quick", "--steps", "2",
         "--warmup", "1", "--threads", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    last = proc.stdout.strip().splitlines()[-1]
    result = json.loads(last)
    assert {"lm", "mlp", "machine", "steps"} <= set(result)
    assert result["steps"] == 2
    assert isinstance(result["machine"], str) and result["machine"]
    for workload in ("lm", "mlp"):
        ratios = result[workload]
        assert set(ratios) == {"default", "activations", "clip_grad_norm", "detect_anomaly"}
        assert all(isinstance(v, float) and v > 0 for v in ratios.values())
    # The guards wrote their run folders under a temporary directory, never into the cwd.
    assert not list(tmp_path.iterdir())


def test_frameworks_quick_prints_json_summary(tmp_path: Path) -> None:
    """benchmarks/frameworks.py --quick: each framework with and without nanguard, one round."""
    for pkg in ("lightning", "transformers", "accelerate"):
        pytest.importorskip(pkg)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "frameworks.py"), "--quick"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("lightning", "transformers", "accelerate"):
        row = result[name]
        assert row["steps_timed"] == 3
        assert row["wall_ratio"] > 0 and row["cpu_ratio"] > 0
    assert not list(tmp_path.iterdir())  # run folders went to a temporary directory
