"""A script resumed under `nanguard run` goes on from the guard of the run it resumes
(run/resume_state.py; issue 40 item 3): a real tiny LM (tests/recover/scripts/lr_jump_lm.py)
trained for J steps and saved by the script itself (`torch.save`, no guard in it), then
resumed by a second `nanguard run` at 10x the LR without warm-up, as nanoGPT's
`--init_from=resume` does.
"""

from __future__ import annotations

import json
import re
import sqlite3
import statistics
from pathlib import Path

import pytest
from tests.helpers import run_python

SCRIPT = Path(__file__).parents[1] / "recover" / "scripts" / "lr_jump_lm.py"
J, LR = 100, 3e-3


def _losses(stdout: str) -> list[float]:
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """The run that saved the checkpoint (under `nanguard run`, in runs/first)."""
    root = tmp_path_factory.mktemp("resume")
    cp = run_python(root, "-m", "nanguard", "run", "--quiet", "--out", str(root / "runs" / "first"),
                    str(SCRIPT), "--steps", str(J), "--lr", str(LR), "--save",
                    str(root / "ckpt.pt"))
    assert cp.returncode == 0, cp.stderr
    return root, _losses(cp.stdout)


def _resume(root: Path, name: str, *flags: str) -> tuple[dict, list[float], Path]:
    out = root / "runs" / name
    cp = run_python(root, "-m", "nanguard", "run", "--quiet", "--out", str(out), *flags,
                    str(SCRIPT), "--steps", "25", "--lr", str(10 * LR), "--resume",
                    str(root / "ckpt.pt"))
    assert cp.returncode == 0, cp.stderr
    return json.loads((out / "report.json").read_text()), _losses(cp.stdout), out


@pytest.fixture(scope="module")
def observed(first: tuple[Path, list[float]]) -> tuple[dict, list[float], Path]:
    """The resume under `--policy observe` (its losses are plain training's: observing never
    changes training)."""
    return _resume(first[0], "observe")


def test_the_resumed_run_counts_on_from_the_saved_step_and_names_the_jump(first, observed):
    _, before = first
    report, losses, out = observed
    with sqlite3.connect(out / "run.db") as db:
        steps = [s for (s,) in db.execute("select step from steps order by step")]
    assert steps[0] == J and steps[-1] == J + 24  # the script's own step numbers
    jump = next(a for a in report["alarms"] if a["kind"] == "lr_jump")
    assert jump["step"] == J and jump["value"] == pytest.approx(10.0)
    assert "10x at the resume, step 100 (0.003 -> 0.03)" in jump["message"]
    # The loss after the resume is compared with the loss at save, from the run before it
    # (the level the script's own prints give: the median of its last 16 losses).
    at_save = statistics.median(before[-16:])
    found = [a for a in report["alarms"] if a["kind"] == "resume_loss"]
    assert len(found) == 1 and J < found[0]["step"] <= J + 11, report["alarms"]
    saved = re.search(r"the loss recorded at save \(([\d.]+)", found[0]["message"])
    assert saved is not None and float(saved[1]) == pytest.approx(at_save, rel=2e-3)
    assert max(losses) > 2 * at_save  # the planted fault, from the script's own prints


def test_heal_ramps_from_the_saved_lr_at_the_resumes_first_step(first, observed):
    root, _ = first
    report, losses, out = _resume(root, "heal", "--policy", "heal")
    assert [(a["step"], a["action"]) for a in report["actions"]][:1] == [(J, "lr_ramp")]
    with sqlite3.connect(out / "run.db") as db:
        lr = db.execute("select lr from steps where step = ?", (J,)).fetchone()[0]
    assert lr == pytest.approx(LR)  # the LR at save, not 10x it
    assert max(losses) < 0.6 * max(observed[1])
