"""The suite's xdist grouping (tests/xdist_groups.py) names modules that exist, and
the default run schedules by group: a renamed module would silently lose its group, and its
expensive shared fixture would be built again on every worker that draws one of its tests."""

from __future__ import annotations

from pathlib import Path

from xdist_groups import ONE_WORKER, one_worker_group

ROOT = Path(__file__).resolve().parents[1]


def test_every_grouped_module_exists() -> None:
    missing = [m for m in ONE_WORKER if not (ROOT / m.split("::")[0]).is_file()]
    assert not missing, f"tests/xdist_groups.py's ONE_WORKER names missing modules: {missing}"


def test_the_default_run_schedules_by_group() -> None:
    addopts = [ln for ln in (ROOT / "pyproject.toml").read_text().splitlines()
               if ln.startswith("addopts")]
    assert len(addopts) == 1 and "--dist loadgroup" in addopts[0], addopts


def test_grouping() -> None:
    assert one_worker_group("tests/test_live.py::test_quiet_and_log_level") == "live"
    assert one_worker_group("tests/programs/test_programs.py::test_gpt_resume_healthy") \
        == "gpt-checkpoint"
    assert one_worker_group("tests/programs/test_programs.py::test_gpt_healthy") \
        == "tests/programs/test_programs.py::test_gpt_healthy"
