"""Shared test setup: import the package from `src/` when it is not installed, one CPU thread
(the suite runs on small shared machines and tiny models gain nothing from more), and fixtures
that build guards the way most tests want them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
try:
    import nanguard  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import helpers`

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)
# And one thread in every process a test starts (they inherit this environment): two xdist
# workers on two cores, each starting a training script with a thread per core, wait on each
# other's spinning threads (a 2-seed demo beside another job: 14.5 s with the default, 6.8 s).
os.environ["OMP_NUM_THREADS"] = "1"


# Tests that share an expensive, once-per-process result run on one xdist worker: otherwise
# each worker that draws one of them builds it again. Node id prefix -> group.
_ONE_WORKER = {
    # docs/doc_shell.py runs each documented training command once per process: the pages'
    # and transcripts' 20 training commands are 9 distinct ones.
    "tests/docs/test_fenced_blocks.py": "docs-pages",
    # A module-scoped fixture that trains (or starts processes) for several tests.
    "tests/test_early_warning.py": "early-warning",
    "tests/test_live.py": "live",
    "tests/cli/test_cli_demo_report_replay.py": "demo-report-replay",
    "tests/integrations/test_torchrun.py": "torchrun",
    "tests/recover/test_lr_jump.py": "lr-jump",
    "tests/test_spike_measures_run.py": "spike-measures-run",
    "tests/explain/test_transient_verdict.py": "transient-verdict",
    "tests/frameworks/test_transformers_resume.py": "transformers-resume",
    "tests/frameworks/test_export_cli.py": "export-cli",
    "tests/programs/test_programs.py::test_gpt_resume": "gpt-checkpoint",
}


def _group(nodeid: str) -> str:
    """The group of a test: a key of `_ONE_WORKER` its node id starts with, else its own."""
    return next((g for prefix, g in _ONE_WORKER.items() if nodeid.startswith(prefix)), nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` (pyproject's addopts), grouped by `_ONE_WORKER`. xdist's own loadgroup
    reads `xdist_group` marks into node ids through an attribute pytest 9 no longer has, so
    its groups fall apart silently; this scheduler groups by node id instead. Larger groups go
    first (xdist's reordering), every other test alone, to whichever worker is free."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return _Groups(config, log)


@pytest.fixture
def quiet_config():
    """A GuardConfig factory with the terminal summary off (tests read the report instead)."""
    from nanguard import GuardConfig, RecordConfig, WatchConfig

    def make(*, out: str | None = None, policy: str = "observe", **watch: object) -> GuardConfig:
        return GuardConfig(
            policy=policy,
            record=RecordConfig(out=out, summary=False),
            watch=WatchConfig(**watch),  # type: ignore[arg-type]
        )

    return make


# Every report.json a test writes is validated against the shipped schema (report.schema.json):
# a key added to Report without the schema, or a value of a new shape, fails the test that
# wrote it. In this process each Report.write is checked; reports a subprocess wrote (nanguard
# run, torchrun, a framework's script) are checked when the test ends, if they lie under its
# tmp_path. Cheap: one compiled validator, a few ms per report.
_schema_errors: list[str] = []
_validators: list[Any] = []


@pytest.fixture(scope="session", autouse=True)
def _validate_written_reports():
    try:
        import jsonschema
    except ImportError:  # the dev extra has it; without it the check is left out
        yield
        return
    from nanguard.record import report as report_module

    validator = jsonschema.Draft202012Validator(report_module.report_schema())
    _validators.append(validator)
    original = report_module.Report.write

    def write(self, folder):  # type: ignore[no-untyped-def]
        for error in validator.iter_errors(self.to_dict()):
            _schema_errors.append(f"{folder}: {list(error.absolute_path)}: {error.message}")
        return original(self, folder)

    report_module.Report.write = write  # type: ignore[method-assign]
    try:
        yield
    finally:
        report_module.Report.write = original  # type: ignore[method-assign]


def _check_written(folder: Path) -> None:
    """Validate the report.json files a test (or its subprocesses) left under `folder`."""
    for path in folder.rglob("report.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not a report (or a test's deliberately broken one): load_report says so
        if not isinstance(report, dict) or "schema_version" not in report:
            continue  # one from before the schema (a test's legacy fixture) claims nothing
        for error in _validators[0].iter_errors(report):
            _schema_errors.append(f"{path}: {list(error.absolute_path)}: {error.message}")


@pytest.fixture(autouse=True)
def _no_schema_errors(request):
    yield
    # The folder outlives its fixture (pytest keeps the last runs' tmp dirs), and the value is
    # still in funcargs although tmp_path's own teardown may have run first.
    folder = getattr(request.node, "funcargs", {}).get("tmp_path")
    if _validators and isinstance(folder, Path) and folder.is_dir():
        _check_written(folder)
    errors, _schema_errors[:] = list(_schema_errors), []
    assert not errors, "report.json does not follow report.schema.json:\n" + "\n".join(errors)
