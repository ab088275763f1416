"""`nanguard run` on unmodified scripts, in real subprocesses: the plain loop (its own guard
too), argparse + LR scheduler, a GAN with two optimizers; the script's stdout and exit code
kept; a script's own failure reported as the script's; a missing script; the re-run's budget."""

from __future__ import annotations

from pathlib import Path

from _run import EXAMPLES, nanguard_run, report


def test_plain_loop_nan_row_found_and_pinpointed(tmp_path: Path) -> None:
    out = tmp_path / "plain"
    r = nanguard_run(out, EXAMPLES / "plain_loop.py")
    assert r.returncode == 1, r.stderr  # training failed
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 200
    assert (first["step"], first["phase"], first["samples"]) == (150, "data", [7])
    # The re-run with the checker armed found the op that first consumed it, in the script.
    assert rep["run"]["replay"]["status"] == "found"
    assert first["op"] == "aten.addmm" and first["source"].endswith("plain_loop.py:22")
    assert rep["diagnosis"][0]["cause"] == "data_nonfinite"
    assert (out / "run.db").is_file()
    assert "first non-finite at step 150" in r.stderr
