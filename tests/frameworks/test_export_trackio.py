"""trackio exporter (`nanguard.export.trackio.write_run`) into a local store, read back with
trackio's own storage reader: the NaN loss is at its step (not dropped, not replaced), the 0/1
nonfinite/skipped series mark that step only, one alert per event sits at its step with the
alarm, action and finding, and the run config names the first non-finite step and top cause.

trackio fixes its store (`TRACKIO_DIR`) when first imported, so the export and the read-back
run in a fresh process, and nothing of trackio is imported into the test process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trackio")

from export_rig import BAD, check_events, check_series, nan_run  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[3])
from nanguard.export.trackio import write_run
[name] = write_run(sys.argv[1], project="ng", dir=sys.argv[2])
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("ng", name)
alerts = SQLiteStorage.get_alerts("ng", run_name=name)
configs = SQLiteStorage.get_run_config("ng", name)
print("RESULT", json.dumps({"name": name, "logs": logs, "alerts": alerts, "configs": configs},
                 default=str))
"""


def test_nan_step_kept_and_marked(tmp_path):
    nan_run(tmp_path / "run")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"),
                          str(tmp_path / "trackio"), str(SRC)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    assert got["name"] == "run"
    assert (tmp_path / "trackio").is_dir()

    def series(name):
        return {int(r["step"]): float(r[f"nanguard/{name}"]) for r in got["logs"]
                if f"nanguard/{name}" in r}

    # json.dumps wrote the read-back NaN as NaN, json.loads gives it back as a float nan
    check_series(series("loss"), series("nonfinite"), series("skipped"))
    texts = {(int(a["step"]), a["title"].removeprefix("nanguard ")): a["text"]
             for a in got["alerts"]}
    check_events(texts)
    levels = {a["title"]: a["level"] for a in got["alerts"] if int(a["step"]) == BAD}
    assert levels["nanguard alarms"] == "warn" and levels["nanguard first_nonfinite"] == "error"
    config = got["configs"]
    assert config["nanguard/first_nonfinite_step"] == BAD
    assert config["nanguard/top_cause"] == "data_nonfinite"
