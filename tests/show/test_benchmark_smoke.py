"""Smoke test of benchmarks/html_report.py on a small synthetic run (no timing asserted; its
size budget is). Marker `bench`: out of the default run, CI runs it (-m bench)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import CHROMIUM

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.bench


def test_html_benchmark_small(tmp_path: Path) -> None:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "html_report.py"), "--steps", "5000",
         "--layers", "20", "--param-every", "10", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(  # nanguard need not be installed
            [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "budget: size <= 10 MB OK" in proc.stdout, proc.stdout
