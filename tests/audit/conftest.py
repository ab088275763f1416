"""Helpers for the offline-auditor tests: run the CLI in-process or in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import nanguard
from nanguard.cli.main import main

SRC = str(Path(nanguard.__file__).resolve().parents[1])


@pytest.fixture
def cli(capsys):
    """Run `nanguard ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: object) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run


def run_subprocess(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run `python -m nanguard ARGS...` as a real process."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "nanguard", *[str(a) for a in args]],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=120,
    )  # fmt: skip


def assert_one_line_error(code: int, err: str) -> None:
    """Exit code 2, no traceback, exactly one non-empty line on stderr."""
    assert code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
