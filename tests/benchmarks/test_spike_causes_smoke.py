"""Smoke tests of benchmarks/spike_causes.py and benchmarks/heal_cost.py (`--quick`: a few
steps, one seed): every cause under every configuration runs end to end and the last line is
the JSON summary. Beyond the shape, what `--quick` already shows: the LR jump (and the resume
at 10x the LR, and the 50x jump to a held LR) is named with its step and factor, the bad batch
is named (the loader's own record is the truth), `observe` trains bit for bit like plain, heal
cuts nothing for a bad batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A benchmark's smoke test: left out of the default run, CI runs it (-m bench).
pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, tmp_path: Path, *args: str) -> tuple[dict, list[str]]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout.strip().splitlines()
    return json.loads(out[-1]), out


def test_spike_causes_quick_runs_every_cause_and_config(tmp_path: Path) -> None:
    result, out = _run("spike_causes.py", tmp_path)
    res = result["results"]
    assert set(res) == {"bad", "jump", "jump_held", "resume", "lr_wd"}
    for by in res.values():
        assert set(by) == {"plain", "clip", "zclip", "observe", "skip", "rollback", "heal"}
        for runs in by.values():
            (r,) = runs
            assert {"episodes", "in_spike", "final_loss", "peak_loss", "wall_s"} <= set(r)
            assert r["wall_s"] > 0 and r["final_loss"] > 0
    # observing never changes training
    for by in res.values():
        assert by["observe"][0]["final_loss"] == by["plain"][0]["final_loss"]
    (bad,) = res["bad"]["observe"]
    assert len(bad["bad_truth"]) == 1 and bad["bad_named_ok"] is True, bad
    heal = res["bad"]["heal"][0]
    assert heal["bad_named_ok"] is True and heal["cuts"] == [], heal
    for cause in ("jump", "resume"):
        assert res[cause]["observe"][0]["jumps"] == [[40, 10.0]], res[cause]["observe"]
    assert res["jump_held"]["observe"][0]["jumps"] == [[40, 50.0]], res["jump_held"]["observe"]
    assert any(line.startswith("cause") and "in spike" in line for line in out)
    assert not list(tmp_path.iterdir())  # run folders went to temporary directories


def test_heal_cost_quick(tmp_path: Path) -> None:
    result, out = _run("heal_cost.py", tmp_path)
    res = result["results"]
    assert set(res) == {"plain", "clip", "observe", "heal", "heal_nb", "heal_over_observe"}
    assert res["heal"]["heal_own_us"] > 0 and res["observe"]["heal_own_us"] == 0
    assert res["plain"]["reads"] == 0 and res["clip"]["reads"] == 0
    assert res["heal"]["reads"] >= 1  # the guard's packet read, at least
    assert res["clip"]["ops"] > res["plain"]["ops"]
    assert all(r["ms"] > 0 for k, r in res.items() if k != "heal_over_observe")
    assert not list(tmp_path.iterdir())
