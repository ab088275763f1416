"""How `nanguard run` names a script's own error: one that came after nanguard found the
numbers running away followed from them (pytorch/examples' word_language_model at
`--lr 1000` dies in `math.exp(cur_loss)`: it was called "its own error, not a numerical
one"); a bookkeeping bug in a healthy run stays the script's own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from helpers import child_env
from in_process import nanguard
from nanguard.record.report import Report
from nanguard.run.run_output import error_text, numeric_error

SCRIPT = str(Path(__file__).parent / "scripts" / "perplexity_lm.py")


def _last_line(text: str) -> str:
    return [ln for ln in text.splitlines() if ln.startswith("nanguard run: ")][-1]


def test_an_overflow_after_divergence_followed_from_the_numbers(tmp_path: Path) -> None:
    r = nanguard(["run", "--out", str(tmp_path / "r"), SCRIPT, "--lr", "1000"], tmp_path)
    # The script's own prints: its loss ran away, then its own math.exp overflowed.
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", r.stdout, re.M)]
    assert len(losses) >= 2 and losses[-1] > 10 * losses[0], r.stdout  # running away
    assert "OverflowError: math range error" in r.stderr, r.stderr[-2000:]
    assert r.returncode == 1
    line = _last_line(r.stderr)
    assert "followed from the numbers" in line and "not a numerical one" not in line, line
    assert re.search(r"\((divergence|overflow|cascade|forecast) at step \d+", line), line
    assert "OverflowError: math range error" in line


def test_a_hand_written_update_is_warned_about_before_the_scripts_own_crash(
        tmp_path: Path) -> None:
    """A hand-written update has no `optimizer.step()` to end it: its step ends at the next
    forward, after the script's own logging. The runaway loss is known before the update (the
    loss alone), so it is said there, before the script prints it and dies of it; it came
    after the script's traceback, when the step's end never came. One stream, in order."""
    proc = subprocess.run(
        [sys.executable, "-m", "nanguard", "run", "--out", str(tmp_path / "r"), SCRIPT,
         "--lr", "1000", "--hand-written"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, timeout=300,
        env=child_env(PYTHONUNBUFFERED="1"))
    out = proc.stdout
    assert proc.returncode == 1 and "OverflowError: math range error" in out, out[-2000:]
    warned = re.search(r"^nanguard: step (\d+) (divergence|cascade|forecast|overflow)", out, re.M)
    assert warned is not None, out[-3000:]
    assert warned.start() < out.index("Traceback"), out[:3000]
    # The script's own prints up to the crash show the loss it was warned about running away.
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", out, re.M)]
    assert losses and losses[-1] > 10 * losses[0], out[:3000]


def test_a_bookkeeping_bug_in_a_healthy_run_is_the_scripts_own(tmp_path: Path) -> None:
    r = nanguard(["run", "--out", str(tmp_path / "r"), SCRIPT, "--fail-at", "12"], tmp_path)
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)", r.stdout, re.M)]
    assert len(losses) == 12 and max(losses) < 2 * losses[0], r.stdout  # the script's own
    line = _last_line(r.stderr)
    assert "its own error, not a numerical one: KeyError" in line, line


def test_the_scripts_own_exit_after_divergence_says_so(tmp_path: Path) -> None:
    r = nanguard(["run", "--out", str(tmp_path / "r"), SCRIPT, "--lr", "1000",
                  "--exit-above", "1e5"], tmp_path)
    assert "above 100000: stopping" in r.stderr  # the script's own check ended it
    line = _last_line(r.stderr)
    assert "the script's own exit, after nanguard found the numbers running away" in line, line
    assert "not a nanguard failure" not in line


def test_arithmetic_errors_are_named_as_such() -> None:
    healthy = Report(status="healthy", steps=20)
    assert numeric_error("ValueError: math domain error")
    assert numeric_error("ZeroDivisionError: float division by zero")
    assert numeric_error("ValueError: cannot convert float NaN to integer")
    assert not numeric_error("ValueError: too many values to unpack (expected 2)")
    text = error_text("train.py", "ValueError: math domain error", healthy)
    assert "arithmetic error of its own" in text and "not a numerical one" not in text
    # An arithmetic error after a runaway finding followed from it; another error is named
    # beside the finding, not blamed on it.
    ran = Report(status="warned", steps=5, alarms=[
        {"step": 1, "kind": "spike", "signal": "grad_norm", "value": 9.0, "message": ""},
        {"step": 3, "kind": "divergence", "signal": "loss", "value": 9.0, "message": ""}])
    text = error_text("train.py", "OverflowError: math range error", ran)
    assert "arithmetic error that followed from the numbers" in text
    assert "divergence at step 3" in text
    text = error_text("train.py", "KeyError: 'epoch'", ran)
    assert "its own error, after nanguard found the numbers running away" in text, text
    assert "followed from" not in text and "divergence at step 3" in text
    # A spike alone (it may heal) is no runaway.
    spike = Report(status="warned", steps=5, alarms=ran.alarms[:1])
    assert "not a numerical one" in error_text("train.py", "KeyError: 'epoch'", spike)
