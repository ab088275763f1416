"""The suite's xdist grouping (tests/conftest.py's `_ONE_WORKER`) names modules that exist, and
the default run schedules by group: a renamed module would silently lose its group, and its
expensive shared fixture would be built again on every worker that draws one of its tests."""

from __future__ import annotations

from pathlib import Path

import tomllib

import conftest

ROOT = Path(__file__).resolve().parents[1]


def test_every_grouped_module_exists() -> None:
    missing = [m for m in conftest._ONE_WORKER if not (ROOT / m.split("::")[0]).is_file()]
    assert not missing, f"tests/conftest.py's _ONE_WORKER names missing modules: {missing}"


def test_the_default_run_schedules_by_group() -> None:
    opts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "--dist loadgroup" in opts["ini_options"]["addopts"]


def test_grouping() -> None:
    assert conftest._group("tests/test_live.py::test_quiet_and_log_level") == "live"
    assert conftest._group("tests/programs/test_programs.py::test_gpt_resume_healthy") \
        == "gpt-checkpoint"
    assert conftest._group("tests/programs/test_programs.py::test_gpt_healthy") \
        == "tests/programs/test_programs.py::test_gpt_healthy"
