"""The documentation site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, offline: no
broken link, no missing page, every API docstring rendered by mkdocstrings, and the generated
pages (each command's --help, report.json from its schema) filled in. README.md stays the
short front door."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings")
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "NO_MKDOCS_2_WARNING": "1",
             "PYTHONPATH": str(ROOT / "src")},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "exit codes:" in cli and "nanguard audit" in cli
    assert "<!-- generated" not in cli
    schema_page = (site / "reference" / "report-json" / "index.html").read_text()
    assert "schema_version" in schema_page and "first_nonfinite" in schema_page
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "on_alarm" in api and "NanguardCallback" in api


def test_readme_is_the_front_door() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 160
    text = "\n".join(lines[:60])
    assert "nanguard: step 10 spike" in text  # the live warning on the first screen
