"""`nanguard run` on unmodified framework scripts, black box (real subprocesses, as the program
suite in tests/programs runs its scripts): a PyTorch Lightning forecaster (`scripts/pl_sensors.py`,
Lightning runs the training step inside `optimizer.step(closure)`) and a transformers `Trainer`
regression with a custom `compute_loss` (`scripts/hf_clicks.py`, tiny BERT from a config).

Each script has a healthy configuration (status `healthy`, no alarm, every step watched) and a
flag that breaks it numerically. The expected finding is established without nanguard: the step
and phase from the same script under the program suite's plain-PyTorch tracer (the scripts drive
it from a framework callback when NANTRACE=1), and the cause from how the run was broken; for the
Lightning script the step is also known by arithmetic (no shuffling: dead row 29 of batches of 8
is in step 3, row 5 of that batch).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "programs"))
from programs_support import Guarded, both, report_exit  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LIGHTNING = str(SCRIPTS / "pl_sensors.py")  # absolute: programs_support joins it as is
TRAINER = str(SCRIPTS / "hf_clicks.py")


def _finding(g: Guarded) -> dict[str, Any]:
    first = g.report.get("first_nonfinite") or {}
    return {"status": g.report["status"], "exit": g.proc.returncode,
            "step": first.get("step"), "phase": first.get("phase"),
            "cause": g.causes[0] if g.causes else None}


@pytest.mark.parametrize("script", [LIGHTNING, TRAINER], ids=["lightning", "trainer"])
def test_healthy_script_is_healthy(tmp_path: Path, script: str) -> None:
    traced, g = both(tmp_path, script)
    assert traced.first is None and traced.steps == 12
    got = {"exit": g.proc.returncode, "status": g.report["status"], "steps": g.report["steps"],
           "alarms": g.report["alarms"]}
    assert got == {"exit": 0, "status": "healthy", "steps": 12, "alarms": []}, g.explain()


def test_lightning_eps0_division_by_zero(tmp_path: Path) -> None:
    """`--eps 0`: a dead sensor window standardized by sqrt(0): NaN made in the forward of
    step 3, sample 5 of its batch."""
    traced, g = both(tmp_path, LIGHTNING, "--eps", "0")
    assert traced.first is not None
    assert (traced.first["step"], traced.first["phase"]) == (29 // 8, "forward")
    want = {"status": "failed", "exit": 1, "step": 3, "phase": "forward",
            "cause": "division_by_zero"}
    assert _finding(g) == want, g.explain()
    assert g.first["samples"] == [29 % 8], g.explain()
    assert report_exit(g.out) != 0


def test_trainer_log_of_zero(tmp_path: Path) -> None:
    """`--log-offset 0`: the log-space loss takes log(0) for a text with no clicks: -inf made
    in the loss (outside the model, in the Trainer subclass's compute_loss) at the step the
    tracer names."""
    traced, g = both(tmp_path, TRAINER, "--log-offset", "0")
    assert traced.first is not None and traced.first["phase"] == "loss", traced
    want = {"status": "failed", "exit": 1, "step": traced.first["step"], "phase": "loss",
            "cause": "log_of_nonpositive"}
    assert _finding(g) == want, g.explain()
    assert g.first.get("op") == "aten.log", g.explain()
