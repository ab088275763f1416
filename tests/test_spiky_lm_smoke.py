"""Smoke test of benchmarks/spiky_lm.py: every configuration runs end to end (`--quick`: 40
steps, one seed) and the last line is the JSON summary. No number is asserted but its shape."""

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


def test_spiky_lm_quick_runs_every_config(tmp_path: Path) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "spiky_lm.py"), "--quick"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()
    result = json.loads(out[-1])
    assert result["steps"] == 40 and result["seeds"] == [0]
    assert set(result["results"]) == {"stable", "plain", "clip", "zclip", "skip_sigma",
                                      "nanguard_observe", "nanguard_skip", "nanguard_rollback",
                                      "nanguard_heal", "nanguard_heal_lr", "nanguard_heal_wd",
                                      "nanguard_heal_clip", "stable_observe", "stable_heal"}
    for runs in result["results"].values():
        (r,) = runs
        assert {"episodes", "time_in_spike", "episodes_median", "score_loss", "val_loss",
                "wall_s", "alarms", "weights"} <= set(r)
        assert r["wall_s"] > 0 and r["val_loss"] > 0
    assert any(line.startswith("config") and "in spike" in line for line in out)
    # observing never changes training: the same weights, bit for bit
    assert result["results"]["stable_observe"][0]["weights"] == (
        result["results"]["stable"][0]["weights"])
    assert not list(tmp_path.iterdir())  # run folders went to temporary directories
