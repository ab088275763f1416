"""report.json against its JSON Schema (src/nanguard/record/report.schema.json, draft 2020-12):
the schema is valid, ships in the package and is what `nanguard report --schema` prints; its
keys and statuses are the `Report` dataclass's; and the reports of a healthy run, a failed run
(with the op-level finding and diagnosis), a merged multi-optimizer `nanguard run`, a run
rebuilt from run.db after its process died (`died`) and a run still training (`running`) all
validate. (tests/conftest.py also validates every report any test writes in process.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanguard
from in_process import nanguard as run_cli
from nanguard.cli.main import main
from nanguard.record.report import (
    SCHEMA_VERSION,
    STATUSES,
    Report,
    load_report,
    report_schema,
)

jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
ENV = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}


def _validate(report: dict[str, Any]) -> None:
    validator = jsonschema.Draft202012Validator(report_schema())
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(report)]
    assert not errors, errors


def _train(out: Path, *, nan_at: int | None = None, close: bool = True, steps: int = 6
           ) -> nanguard.Guard:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def replay(batch: Any) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = nanguard.Guard(model, opt, out=str(out), replay=replay,
                           config=nanguard.GuardConfig(record=nanguard.RecordConfig(
                               summary=False)))
    for step in range(steps):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == nan_at:
            x[3, 1] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if close:
        guard.close()
    return guard


def test_schema_is_valid_and_matches_the_report_dataclass() -> None:
    schema = report_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(schema["properties"]) == set(Report.__dataclass_fields__)
    assert set(schema["required"]) == set(Report.__dataclass_fields__)
    assert schema["properties"]["status"]["enum"] == list(STATUSES)
    assert Report().to_dict()["schema_version"] == SCHEMA_VERSION >= 1


def test_report_schema_flag_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", "--schema"]) == 0
    assert json.loads(capsys.readouterr().out) == report_schema()


def test_healthy_and_failed_runs(tmp_path: Path) -> None:
    _train(tmp_path / "ok")
    healthy = json.loads((tmp_path / "ok" / "report.json").read_text())
    assert healthy["status"] == "healthy" and healthy["schema_version"] == SCHEMA_VERSION
    _validate(healthy)
    _train(tmp_path / "bad", nan_at=3)
    failed = json.loads((tmp_path / "bad" / "report.json").read_text())
    assert failed["status"] == "failed" and failed["first_nonfinite"]["step"] == 3
    assert failed["diagnosis"] and failed["alarms"]
    _validate(failed)


def test_running_and_died_runs(tmp_path: Path) -> None:
    guard = _train(tmp_path / "live", close=False)
    try:
        guard.store.flush()
        running = load_report(tmp_path / "live")
        assert running.status == "running"
        _validate(running.to_dict())
    finally:
        guard.close()
    # Processes that never close their guard (os._exit: as SIGKILL leaves them): a healthy
    # one is `died`; one that saw a NaN first is `failed` (the NaN decides), both rebuilt.
    code = (
        "import os, sys, pathlib\n"
        "sys.path.insert(0, sys.argv[2])\n"
        "from test_report_schema import _train\n"
        "nan_at = int(sys.argv[3]) if sys.argv[3] != '-' else None\n"
        "g = _train(pathlib.Path(sys.argv[1]), nan_at=nan_at, close=False)\n"
        "g.store.flush()\n"
        "os._exit(0)\n"
    )
    for name, nan_at, status in (("dead", "-", "died"), ("dead-nan", "2", "failed")):
        subprocess.run([sys.executable, "-c", code, str(tmp_path / name),
                        str(Path(__file__).parent), nan_at],
                       check=True, env=ENV, timeout=120, capture_output=True)
        rebuilt = load_report(tmp_path / name)
        assert rebuilt.status == status and rebuilt.run["closed"] is False
        _validate(rebuilt.to_dict())


def test_merged_multi_optimizer_run(tmp_path: Path) -> None:
    script = tmp_path / "gan.py"
    script.write_text(
        "import torch\n"
        "torch.manual_seed(0)\n"
        "g, d = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)\n"
        "og, od = torch.optim.SGD(g.parameters(), lr=0.01), torch.optim.SGD(d.parameters(), "
        "lr=0.01)\n"
        "for step in range(6):\n"
        "    z = torch.randn(8, 4)\n"
        "    if step == 4:\n"
        "        z[0, 0] = float('nan')\n"
        "    loss_d = d(g(z).detach()).mean() - d(torch.randn(8, 4)).mean()\n"
        "    od.zero_grad(); loss_d.backward(); od.step()\n"
        "    loss_g = -d(g(z)).mean()\n"
        "    og.zero_grad(); loss_g.backward(); og.step()\n"
    )
    out = tmp_path / "run"
    # The command's `main` in this process: the files it writes are what is read.
    run_cli(["run", "--quiet", "--replay-budget", "0", "--fork-every", "0", "--out", str(out),
              str(script)], tmp_path)
    merged = json.loads((out / "report.json").read_text())
    assert len(merged["run"]["parts"]) == 2, merged["run"]
    assert merged["schema_version"] == SCHEMA_VERSION
    _validate(merged)
    for part in out.glob("optimizer-*/report.json"):
        _validate(json.loads(part.read_text()))


def test_a_report_from_before_the_schema_says_version_0(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps({"status": "healthy", "steps": 3}))
    old = load_report(tmp_path)
    assert old.schema_version == 0
    _validate(old.to_dict())
