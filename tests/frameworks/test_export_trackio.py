"""trackio exporter (`nanguard.export.trackio.write_run`) into a local store, read back with
trackio's own storage reader: the NaN loss is at its step (not dropped, not replaced), the 0/1
nonfinite/skipped series mark that step only, one alert per event sits at its step with the
alarm, action and finding, and the run config names the first non-finite step and top cause.

trackio fixes its store (`TRACKIO_DIR`) when first imported, so the export and the read-back
run in a fresh process, and nothing of trackio is imported into the test process."""

from __future__ import annotations

import json
import os
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


LIVE = """
import json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import trackio
from trackio.sqlite_storage import SQLiteStorage
from export_rig import NAN_AT, cascade_live
from nanguard.export import trackio as ng

def read(name, until=None):
    deadline = time.monotonic() + 30
    while True:  # trackio writes from a thread of its own (logs and alerts each on their
        # own schedule: seen under load, the step's log there before its alert): poll for both
        logs = SQLiteStorage.get_logs("ng", name)
        alerts = SQLiteStorage.get_alerts("ng", run_name=name)
        if until is None or (any(r["step"] == until and "nanguard/loss" in r for r in logs)
                             and any(int(a["step"]) == until for a in alerts)) \\
                or time.monotonic() > deadline:
            return logs, alerts
        time.sleep(0.2)

out = {}
if sys.argv[3] == "new":
    handle, _, out["live"] = cascade_live(sys.argv[4], lambda g: ng.stream(g, project="ng"),
                                          lambda h: read(h.target.name, NAN_AT))
    out["current_is_none"] = trackio.context_vars.current_run.get() is None
    name = handle.target.name
else:
    trackio.init(project="ng", name="mine", embed=False, auto_log_gpu=False,
                 auto_log_cpu=False)
    trackio.log({"my_loss": 1.0})
    handle, _, _ = cascade_live(sys.argv[4], ng.stream)
    trackio.log({"my_loss": 2.0})  # still the current run
    trackio.finish()
    name = "mine"
out["name"] = name
out["logs"], out["alerts"] = read(name)
out["runs"] = SQLiteStorage.get_runs("ng")
print("RESULT", json.dumps(out, default=str))
"""


def _live(tmp_path, mode):
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    out = subprocess.run([sys.executable, "-c", LIVE, str(SRC), str(Path(__file__).parent),
                          mode, str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    [line] = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def _series(logs, key):
    return {int(r["step"]): float(r[f"nanguard/{key}"]) for r in logs if f"nanguard/{key}" in r}


def _texts(alerts):
    return {(int(a["step"]), a["title"].removeprefix("nanguard ")): a["text"] for a in alerts}


def test_stream_live(tmp_path):
    """The cascade streamed into a new run (TRACKIO_DIR honoured): the NaN step's values and
    alarm alert are in the store while training goes on; at close the finding and the report;
    the run is not left as trackio's current run."""
    from export_rig import NAN_AT, check_cascade, check_cascade_events

    got = _live(tmp_path, "new")
    logs, alerts = got["live"]
    check_cascade(_series(logs, "loss"), _series(logs, "nonfinite"), until=NAN_AT)
    check_cascade_events(_texts(alerts), closed=False)
    check_cascade(_series(got["logs"], "loss"), _series(got["logs"], "nonfinite"))
    check_cascade_events(_texts(got["alerts"]))
    levels = {a["title"]: a["level"] for a in got["alerts"] if int(a["step"]) == NAN_AT}
    assert levels["nanguard first_nonfinite"] == "error"
    assert [a["level"] for a in got["alerts"] if a["title"] == "nanguard report"] == ["error"]
    assert got["current_is_none"] and got["runs"] == [got["name"]] == ["run"]


def test_stream_into_current_run(tmp_path):
    """With a trackio run current, nanguard's values go into it next to the user's own, and it
    stays current: one run in the project, the user's."""
    from export_rig import check_cascade

    got = _live(tmp_path, "user")
    assert got["runs"] == ["mine"]
    assert [r["my_loss"] for r in got["logs"] if "my_loss" in r] == [1.0, 2.0]
    check_cascade(_series(got["logs"], "loss"), _series(got["logs"], "nonfinite"))
