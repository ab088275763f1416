"""Fixtures for the offline-auditor tests: run the CLI in-process."""

from __future__ import annotations

import pytest

from nanguard.cli.main import main


@pytest.fixture
def cli(capsys):
    """Run `nanguard ARGS...` in-process; returns (exit code, stdout, stderr)."""

    def run(*args: object) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
