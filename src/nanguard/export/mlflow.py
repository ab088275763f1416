"""MLflow exporter: a recorded run (run.db + report.json) as an MLflow run.

    from nanguard.export.mlflow import write_run
    run_id = write_run("nanguard_runs/x")            # -> nanguard_runs/x/mlruns (file store)
    # mlflow ui --backend-store-uri nanguard_runs/x/mlruns   (MLFLOW_ALLOW_FILE_STORE=true)
    write_run("nanguard_runs/x", tracking_uri="sqlite:///mlflow.db")   # or a server

Written, per optimizer step (one MLflow run; ranks of a merged folder as one run each):

- metrics `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are;
- metrics `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded);
- a tag per event, `nanguard.event.<step>.<kind>` (kind: alarms, actions, first_nonfinite,
  diagnosis, report) holding its markdown text, and run-level tags `nanguard.status`,
  `nanguard.first_nonfinite_step` / `_phase` / `_module` / `_op`, `nanguard.top_cause`;
- the artifacts `nanguard/events.md` (every event under its step) and `nanguard/report.json`.

What MLflow does with non-finite values: the file store keeps NaN and +-Inf; the database
store (sqlite, MySQL, PostgreSQL, hence a tracking server on one) keeps NaN but turns +-Inf
into +-1.7976931348623157e308; charts leave NaN out. The `nonfinite` series and the event tags
keep the step visible either way.

Needs `mlflow-skinny` (or `mlflow`; `pip install nanguard[mlflow]`); imported only when used.
The default local file store is in maintenance mode in MLflow 3 and refuses to open unless
`MLFLOW_ALLOW_FILE_STORE=true`: the exporter sets it while it writes to a `file:` URI (and
restores it after); a database URI needs the full `mlflow` package (SQLAlchemy, alembic).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nanguard.export._common import Event, RunData, load_run, run_parts, summary

TAG_LIMIT = 5000
"""Longest tag value written (MLflow's own limit is 8000 characters); longer texts are cut."""


def write_run(run: str | Path, tracking_uri: str | None = None,
              experiment: str = "nanguard", run_name: str | None = None) -> list[str]:
    """Write a run folder's steps and events as MLflow runs.

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed), or a folder
            merged from ranks (`rank-R/` parts: one MLflow run each, named `<name>/rank-R`).
        tracking_uri: where to write; default the file store `RUN/mlruns`.
        experiment: MLflow experiment name (created if missing).
        run_name: MLflow run name; default the run folder's name.

    Returns:
        The MLflow run ids written, one per part.

    Raises:
        ValueError: `run` is not a nanguard run folder.
    """
    parts = run_parts(run)
    uri = tracking_uri if tracking_uri is not None else (Path(run) / "mlruns").resolve().as_uri()
    name = run_name or Path(run).resolve().name
    with _file_store_allowed(uri):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else client.create_experiment(experiment)
        return [_write_one(client, exp_id, load_run(folder),
                           name if part is None else f"{name}/{part}")
                for part, folder in parts]


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    key = "MLFLOW_ALLOW_FILE_STORE"
    if not uri.startswith("file:"):
        yield
        return
    before = os.environ.get(key)
    os.environ[key] = "true"
    try:
        yield
    finally:
        if before is None:
            del os.environ[key]
        else:
            os.environ[key] = before


def _write_one(client: Any, exp_id: str, data: RunData, name: str) -> str:
    from mlflow.entities import Metric, RunTag

    run = client.create_run(exp_id, run_name=name)
    rid = run.info.run_id
    status = "FINISHED"
    try:
        metrics = []
        for row in data.steps:
            ms = int((row.time or 0.0) * 1000)
            metrics += [Metric(k, v, ms, row.step) for k, v in row.scalars().items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics per batch
            client.log_batch(rid, metrics=metrics[i:i + 1000])
        tags = [RunTag(f"nanguard.{k}", str(v)) for k, v in summary(data.report).items()]
        tags += [RunTag(f"nanguard.event.{e.step}.{e.tag}", _cut(e.text)) for e in data.events]
        for i in range(0, len(tags), 100):
            client.log_batch(rid, tags=tags[i:i + 100])
        client.log_text(rid, _events_md(data.events), "nanguard/events.md")
        if data.report:
            client.log_text(rid, json.dumps(data.report, indent=1), "nanguard/report.json")
    except BaseException:
        status = "FAILED"
        raise
    finally:
        client.set_terminated(rid, status=status)
    return str(rid)


def _cut(text: str) -> str:
    return text if len(text) <= TAG_LIMIT else text[:TAG_LIMIT - 20] + "\n... (cut)"


def _events_md(events: list[Event]) -> str:
    return "\n\n".join(f"## step {e.step}: {e.tag}\n\n{e.text}" for e in events) + "\n"
