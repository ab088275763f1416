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

from xdist_groups import one_worker_group  # noqa: E402

torch.set_num_threads(1)
# And one thread in every process a test starts (they inherit this environment): two xdist
# workers on two cores, each starting a training script with a thread per core, wait on each
# other's spinning threads (a 2-seed demo beside another job: 14.5 s with the default, 6.8 s).
os.environ["OMP_NUM_THREADS"] = "1"
# W&B writes a running run's records to its .wandb file every 15 s by default, and a test that
# reads rows while training goes on (the live stream) waited that long for them. Set before
# any `wandb.setup()` of this process, which reads the environment once.
os.environ.setdefault("WANDB__TRANSACTION_LOG_FLUSH_INTERVAL", "0.2")


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup` (pyproject's addopts), grouped by tests/xdist_groups.py. xdist's own
    loadgroup reads `xdist_group` marks into node ids through an attribute pytest 9 no longer
    has, so its groups fall apart silently; this scheduler groups by node id instead. Larger
    groups go first (xdist's reordering), every other test alone, to whichever worker is free.
    Runs on the controller only, when the run is distributed."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return one_worker_group(nodeid)

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
