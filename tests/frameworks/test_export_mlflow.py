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
    # The NaN loss at BAD opens a spike episode: the per-step series and the run's count.
    in_spike = _series(client, rid, "in_spike")
    assert [in_spike[s] for s in range(BAD + 1)] == [0.0] * BAD + [1.0]
    assert tags["nanguard.spike_episodes"] == "1"
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


def _texts(client, rid):
    out = {}
    for key, value in client.get_run(rid).data.tags.items():
        if key.startswith("nanguard.event."):
            step, kind = key.removeprefix("nanguard.event.").split(".")
            out[(int(step), kind)] = value
    return out


def test_stream_live_env_store(tmp_path, monkeypatch):
    """No run active: a new run in MLFLOW_TRACKING_URI / MLFLOW_EXPERIMENT_NAME; the NaN step's
    metrics and alarm tag are in the store while training goes on; at close the finding, the
    report tags and artifacts, and the run nanguard opened is finished."""
    from export_rig import NAN_AT, cascade_live, check_cascade, check_cascade_events

    from nanguard.export.mlflow import stream

    uri = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-env")
    client = _client(uri, monkeypatch)

    def during(handle):
        rid = handle.run_id
        assert client.get_run(rid).info.status == "RUNNING"
        return (_series(client, rid, "loss"), _series(client, rid, "nonfinite"),
                _texts(client, rid))

    handle, _, (loss, marks, texts) = cascade_live(tmp_path / "run", stream, during)
    check_cascade(loss, marks, until=NAN_AT)  # live: in the store before the run went on
    check_cascade_events(texts, closed=False)
    rid = handle.run_id
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "from-env"
    assert run.info.run_name == "run"
    check_cascade(_series(client, rid, "loss"), _series(client, rid, "nonfinite"))
    check_cascade_events(_texts(client, rid))
    tags = run.data.tags
    assert tags["nanguard.status"] == "failed"
    assert tags["nanguard.first_nonfinite_step"] == str(NAN_AT)
    assert tags["nanguard.top_cause"] == "optimizer_divergence"
    events = client.download_artifacts(rid, "nanguard/events.md", str(tmp_path / "dl"))
    assert f"## step {NAN_AT}: first_nonfinite" in Path(events).read_text()


def test_stream_into_active_run(tmp_path, monkeypatch):
    """With `mlflow.active_run()`, nanguard's metrics go into it, next to the user's own, and
    it is left running: one run in the experiment, the user's."""
    import mlflow
    from export_rig import cascade_live, check_cascade

    from nanguard.export.mlflow import stream

    uri = (tmp_path / "store").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = _client(uri, monkeypatch)
    exp_id = client.create_experiment("mine")
    with mlflow.start_run(experiment_id=exp_id) as user:
        mlflow.log_metric("my_loss", 1.0, step=0)
        handle, _, _ = cascade_live(tmp_path / "run", stream)
        assert handle.run_id == user.info.run_id
        assert client.get_run(user.info.run_id).info.status == "RUNNING"
        mlflow.log_metric("my_loss", 2.0, step=30)
    rid = user.info.run_id
    assert [r.info.run_id for r in client.search_runs([exp_id])] == [rid]
    assert [m.value for m in client.get_metric_history(rid, "my_loss")] == [1.0, 2.0]
    check_cascade(_series(client, rid, "loss"), _series(client, rid, "nonfinite"))
    assert client.get_run(rid).data.tags["nanguard.top_cause"] == "optimizer_divergence"
    # the after-the-fact exporter follows the same rules: the active run, else the env's store
    with mlflow.start_run(experiment_id=exp_id) as second:
        assert write_run(tmp_path / "run") == [second.info.run_id]
        assert client.get_run(second.info.run_id).info.status == "RUNNING"
    check_cascade(_series(client, second.info.run_id, "loss"),
                  _series(client, second.info.run_id, "nonfinite"))
    [third] = write_run(tmp_path / "run")
    assert client.get_run(third).info.status == "FINISHED"  # in the env's store, finished
    assert not (tmp_path / "run" / "mlruns").exists()
