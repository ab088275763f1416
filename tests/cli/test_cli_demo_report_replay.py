"""The user-facing commands end to end, as a new user runs them: `nanguard demo` prints lead
times and writes run folders; `nanguard report` prints the finding and the diagnosis (and
`--json` the report); `nanguard replay` names the op on a recorded failing demo run; bad paths
give one line and exit 2; `nanguard --help` and `python -m nanguard` work.

`demo`, the mistakes and `--help` run as `python -m nanguard` processes, as a user types them;
`report` and `replay` of the demo's runs read only the run folders, so they run the command's
`main` in the test's process (`_here`: an interpreter start and a torch import less each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

import in_process

ROOT = Path(__file__).resolve().parents[2]


def _nanguard(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "COLUMNS": "160",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "nanguard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _here(*args: str) -> subprocess.CompletedProcess[str]:
    """`nanguard ARGS` by the command's `main` in this process, at the width `_nanguard` sets."""
    with mock.patch.dict(os.environ, {"COLUMNS": "160"}):
        return in_process.nanguard(list(args), Path.cwd())


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("demo")
    proc = _nanguard("demo", "--out", str(out), "--seeds", "2")
    assert proc.returncode == 0, proc.stderr
    return out, " ".join(proc.stdout.split())  # rich wraps long lines


def test_demo_prints_lead_times_and_writes_run_folders(demo: tuple[Path, str]) -> None:
    out, stdout = demo
    # Seeds 0 and 1 both fail (see nanguard.scenarios.cascade); each row shows the lead time.
    assert "2 of 2 seeds hit a non-finite value" in stdout
    assert "2 of 2 seeds warned >= 3 steps ahead" in stdout
    assert "Diagnosis of seed 0: optimizer_divergence" in stdout
    for seed in (0, 1):
        report = json.loads((out / f"seed-{seed}" / "report.json").read_text())
        assert report["status"] == "failed"
        assert report["lead_steps"] >= 3
        assert report["first_nonfinite"]["op"]  # named by the in-process replay
    rollback = json.loads((out / "seed-0-rollback" / "report.json").read_text())
    assert rollback["status"] == "recovered"


def test_report_prints_finding_and_fix(demo: tuple[Path, str]) -> None:
    out, _ = demo
    proc = _here("report", str(out / "seed-0"))
    assert proc.returncode == 1  # the run failed
    text = " ".join(proc.stdout.split())
    assert "first non-finite at step 155" in text
    assert "optimizer_divergence" in text and "clip_grad_norm_" in text
    as_json = _here("report", "--json", str(out / "seed-0"))
    assert json.loads(as_json.stdout)["first_nonfinite"]["step"] == 155


def test_replay_names_the_op_of_a_demo_run(demo: tuple[Path, str]) -> None:
    out, _ = demo
    proc = _here("replay", "--json", str(out / "seed-1"))
    origin = json.loads(proc.stdout)
    recorded = json.loads((out / "seed-1" / "report.json").read_text())["first_nonfinite"]
    assert origin["step"] == recorded["step"] == 228
    assert (origin["phase"], origin["module"], origin["op"]) == ("forward", "2", "aten.addmm")


@pytest.mark.parametrize(
    "command", [["report", "/no/such/run"], ["replay", "/no/such/run"], ["demo", "--seeds", "0"]]
)
def test_user_errors_are_one_line_exit_2(command: list[str]) -> None:
    proc = _nanguard(*command)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert len([ln for ln in proc.stderr.splitlines() if ln.strip()]) == 1


def test_help_lists_every_command() -> None:
    proc = _nanguard("--help")
    assert proc.returncode == 0
    for name in ("run", "demo", "report", "replay", "audit", "scan", "lint"):
        assert name in proc.stdout
