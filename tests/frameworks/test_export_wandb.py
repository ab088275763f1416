"""W&B exporter (`nanguard.export.wandb.write_run`) in offline mode, read back from the run's
own transaction log (`run-<id>.wandb`, see `export_rig.read_wandb`): the NaN loss is stored at
its step as "NaN" (not dropped, not replaced), the 0/1 nonfinite/skipped series mark that step
only, the events panel at that step holds the alarm, action and finding, and the summary names
the first non-finite step and top cause. An active W&B run is written into, not a new one.
Nothing leaves the machine."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("wandb")

import wandb  # noqa: E402
from export_rig import (  # noqa: E402
    BAD,
    STEPS,
    check_events,
    check_series,
    nan_run,
    read_wandb,
    wandb_series,
)

from nanguard.export.wandb import write_run  # noqa: E402


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for key in ("WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(key, raising=False)


def _finished(rows, summary):
    return "nanguard/top_cause" in summary and any("nanguard/event_table/path" in r for r in rows)


def _finished_with_users_rows(rows, summary):
    """nanguard's close is written, and the user's own two rows too: the second is logged after
    nanguard's summary, and W&B's writer (a process of its own) may land it a moment after
    `finish()` returned."""
    return _finished(rows, summary) and sum("my_loss" in r for r in rows) == 2


def test_nan_step_kept_and_marked(tmp_path, offline):
    nan_run(tmp_path / "run")
    [folder] = write_run(tmp_path / "run", mode="offline")
    assert folder.name.startswith("offline-run-") and folder.parent == tmp_path / "run" / "wandb"
    rows, summary, _ = read_wandb(folder, _finished)
    loss = wandb_series(rows, "loss")
    [bad] = [r for r in rows if r.get("nanguard/step") == str(BAD)]
    assert bad["nanguard/loss"] == "NaN"  # stored as NaN, not a running average
    check_series(loss, wandb_series(rows, "nonfinite"), wandb_series(rows, "skipped"))
    assert all(math.isfinite(loss[s]) for s in loss if s != BAD)
    # media are nested keys: ("nanguard/events", "path") -> the file under the run's files/
    panels = {int(r["nanguard/step"]): json.loads(r["nanguard/events/path"]) for r in rows
              if "nanguard/events/path" in r}
    assert sorted(panels) == [BAD, STEPS - 1]
    texts = {}  # (step, kind) -> text (html-escaped; the checks' words have nothing to escape)
    for step, panel in panels.items():
        page = (folder / "files" / panel).read_text()
        for part in page.split("<h3>")[1:]:
            kind, text = part.split("</h3>", 1)
            texts[(step, kind)] = text
    check_events(texts)
    [table_path] = [json.loads(r["nanguard/event_table/path"]) for r in rows
                    if "nanguard/event_table/path" in r]
    table = json.loads((folder / "files" / table_path).read_text())
    assert [BAD, "first_nonfinite"] in [row[:2] for row in table["data"]]
    assert json.loads(summary["nanguard/first_nonfinite_step"]) == BAD
    assert json.loads(summary["nanguard/top_cause"]) == "data_nonfinite"


def test_env_and_active_run(tmp_path, offline, monkeypatch):
    """WANDB_DIR / WANDB_PROJECT place a new run; an active run is written into and left open."""
    nan_run(tmp_path / "run")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wdir"))
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    [folder] = write_run(tmp_path / "run")
    assert folder.parent == tmp_path / "wdir" / "wandb"
    rows, _, _ = read_wandb(folder, _finished)
    assert wandb_series(rows, "nonfinite")[BAD] == 1.0

    user = wandb.init(project="mine", dir=str(tmp_path / "user"),
                      settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
    try:
        user.log({"my_loss": 1.0})
        [folder] = write_run(tmp_path / "run")
        assert wandb.run is user and folder == tmp_path / "user" / "wandb" / folder.name
        assert folder.name.endswith(user.id)
        user.log({"my_loss": 2.0})
    finally:
        user.finish()
    # no second run: the first write's folder is the only one nanguard made
    assert len(list((tmp_path / "wdir" / "wandb").glob("offline-run-*"))) == 1
    assert not (tmp_path / "run" / "wandb").exists()
    rows, summary, _ = read_wandb(folder, _finished_with_users_rows)
    assert [json.loads(r["my_loss"]) for r in rows if "my_loss" in r] == [1.0, 2.0]
    check_series(wandb_series(rows, "loss"), wandb_series(rows, "nonfinite"),
                 wandb_series(rows, "skipped"))
    assert json.loads(summary["nanguard/top_cause"]) == "data_nonfinite"


def _texts(folder, rows):
    """(nanguard/step, kind) -> text of every events panel in the rows."""
    texts = {}
    for r in rows:
        if "nanguard/events/path" in r:
            page = (folder / "files" / json.loads(r["nanguard/events/path"])).read_text()
            for part in page.split("<h3>")[1:]:
                kind, text = part.split("</h3>", 1)
                texts[(int(r["nanguard/step"]), kind)] = text.removeprefix("<pre>")
    return texts


def test_stream_live(tmp_path, offline):
    """The cascade streamed into a new offline run: the NaN step's row and alarm are in the
    run's log while training goes on; at close the finding, the report, the summary and the
    alerts, and the run nanguard opened is finished."""
    from export_rig import NAN_AT, cascade_live, check_cascade, check_cascade_events

    from nanguard.export.wandb import stream

    def during(handle):
        assert wandb.run is None  # its run is not made the global one: user code keeps its own
        folder = handle.wb.folder
        rows, _, _ = read_wandb(folder, lambda rows, _: any(
            r.get("nanguard/step") == str(NAN_AT) and "nanguard/loss" in r for r in rows))
        return folder, rows

    handle, _, (folder, rows) = cascade_live(tmp_path / "run", stream, during)
    assert folder.parent == tmp_path / "run" / "wandb"  # default: the run folder
    check_cascade(wandb_series(rows, "loss"), wandb_series(rows, "nonfinite"), until=NAN_AT)
    check_cascade_events(_texts(folder, rows), closed=False)
    assert handle.wb.owned

    rows, summary, alerts = read_wandb(folder, _finished)
    assert [r["nanguard/loss"] for r in rows if r.get("nanguard/step") == str(NAN_AT)
            and "nanguard/loss" in r] == ["Infinity"]
    check_cascade(wandb_series(rows, "loss"), wandb_series(rows, "nonfinite"))
    check_cascade_events(_texts(folder, rows))
    assert json.loads(summary["nanguard/status"]) == "failed"
    assert json.loads(summary["nanguard/first_nonfinite_step"]) == NAN_AT
    assert json.loads(summary["nanguard/top_cause"]) == "optimizer_divergence"
    assert f"nanguard: nonfinite at step {NAN_AT}" in alerts
    assert f"nanguard: finding at step {NAN_AT}" in alerts


def test_stream_into_active_run(tmp_path, offline):
    """With `wandb.run` active, nanguard's rows go into it (next to the user's own metric) and
    it is left open: one run, the user's."""
    from export_rig import cascade_live, check_cascade

    from nanguard.export.wandb import stream

    user = wandb.init(project="mine", dir=str(tmp_path / "user"),
                      settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
    try:
        user.log({"my_loss": 1.0})
        handle, _, _ = cascade_live(tmp_path / "run", stream)
        assert handle.run is user and not handle.wb.owned
        assert wandb.run is user
        user.log({"my_loss": 2.0})  # still open after the guard closed
    finally:
        user.finish()
    [folder] = (tmp_path / "user" / "wandb").glob("offline-run-*")
    assert folder.name.endswith(user.id)
    assert not (tmp_path / "run" / "wandb").exists()  # no second run
    rows, summary, _ = read_wandb(folder, _finished_with_users_rows)
    assert [json.loads(r["my_loss"]) for r in rows if "my_loss" in r] == [1.0, 2.0]
    check_cascade(wandb_series(rows, "loss"), wandb_series(rows, "nonfinite"))
    assert json.loads(summary["nanguard/top_cause"]) == "optimizer_divergence"


EXIT = """
import sys
sys.path[:0] = [sys.argv[1]]
from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.export import wandb as ng
from nanguard.scenarios.cascade import make_cascade
s = make_cascade(0, steps=20, outlier_at=10)
g = Guard(s.model, s.optimizer, out=sys.argv[2],
          config=GuardConfig(record=RecordConfig(summary=False)))
ng.stream(g)
for x, y in s.batches:
    loss = s.loss_fn(s.model(x), y)
    g.watch(loss=loss, batch=(x, y))
    s.optimizer.zero_grad()
    loss.backward()
    s.optimizer.step()
# no g.close(): the interpreter's exit closes it
"""


def test_stream_guard_left_open_at_exit(tmp_path, offline):
    """A script that never closes its guard: the stream's exit hook closes it before W&B tears
    its run down, so the finding, the summary and the finished run are still written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src"
    proc = subprocess.run([sys.executable, "-c", EXIT, str(src), str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    assert "was removed" not in proc.stderr, proc.stderr  # no exporter listener failed
    [folder] = (tmp_path / "run" / "wandb").glob("offline-run-*")
    rows, summary, _ = read_wandb(folder, _finished)
    assert json.loads(summary["nanguard/top_cause"]) == "optimizer_divergence"
    assert wandb_series(rows, "nonfinite")[19] == 1.0
