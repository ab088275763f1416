"""Helpers shared by the offline-auditor tests (a uniquely named module, so it cannot be
confused with another directory's conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nanguard

SRC = str(Path(nanguard.__file__).resolve().parents[1])


def run_subprocess(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m nanguard ARGS...` as a real process."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "nanguard", *[str(a) for a in args]],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def assert_one_line_error(code: int, err: str) -> None:
    """Exit code 2, no traceback, exactly one non-empty line on stderr."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
