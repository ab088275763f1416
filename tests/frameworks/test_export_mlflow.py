"""MLflow exporter (`nanguard.export.mlflow.write_run`) into a local file store, read back with
MLflow's own client: the NaN loss is at its step (not dropped, not replaced), the 0/1
nonfinite/skipped series mark that step only, one tag per event sits at its step, and the run
tags name the status, the first non-finite step and the top cause. A folder merged from ranks
becomes one MLflow run per rank."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from export_rig import BAD, check_events, check_series, nan_run  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from nanguard.export.mlflow import write_run  # noqa: E402


def _client(uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store else
    return MlflowClient(tracking_uri=uri)


def _series(client, rid, key):
    return {m.step: m.value for m in client.get_metric_history(rid, f"nanguard/{key}")}


def test_nan_step_kept_and_marked(tmp_path, monkeypatch):
    nan_run(tmp_path / "run")
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ
    [rid] = write_run(tmp_path / "run")
    assert "MLFLOW_ALLOW_FILE_STORE" not in os.environ  # set only while writing
    client = _client((tmp_path / "run" / "mlruns").as_uri(), monkeypatch)
    check_series(_series(client, rid, "loss"), _series(client, rid, "nonfinite"),
                 _series(client, rid, "skipped"))
    tags = client.get_run(rid).data.tags
    texts = {}
    for key, value in tags.items():
        if key.startswith("nanguard.event."):
            step, kind = key.removeprefix("nanguard.event.").split(".")
            texts[(int(step), kind)] = value
    check_events(texts)
    assert tags["nanguard.first_nonfinite_step"] == str(BAD)
    assert tags["nanguard.top_cause"] == "data_nonfinite"
    assert tags["nanguard.status"] == "recovered"
    assert client.get_run(rid).info.status == "FINISHED"
    events = client.download_artifacts(rid, "nanguard/events.md", str(tmp_path / "dl"))
    assert f"## step {BAD}: first_nonfinite" in Path(events).read_text()


def test_ranks_become_runs(tmp_path, monkeypatch):
    nan_run(tmp_path / "one")
    for r in (0, 1):
        shutil.copytree(tmp_path / "one", tmp_path / "merged" / f"rank-{r}")
    uri = (tmp_path / "store").as_uri()
    rids = write_run(tmp_path / "merged", tracking_uri=uri, run_name="job")
    client = _client(uri, monkeypatch)
    names = [client.get_run(rid).info.run_name for rid in rids]
    assert names == ["job/rank-0", "job/rank-1"]
    assert all(_series(client, rid, "nonfinite")[BAD] == 1.0 for rid in rids)


def test_not_a_run_refused(tmp_path):
    with pytest.raises(ValueError, match="not a nanguard run folder"):
        write_run(tmp_path)
