"""MLflow exporter: a run as MLflow metrics and tags, live while it trains or after the fact.

    from nanguard.export import mlflow as ng_mlflow
    ng_mlflow.stream(guard)                  # live: into mlflow.active_run(), else a new run
    ng_mlflow.write_run("nanguard_runs/x")   # recorded: likewise; no run active and no
                                             # MLFLOW_TRACKING_URI -> nanguard_runs/x/mlruns
    # mlflow ui --backend-store-uri nanguard_runs/x/mlruns   (MLFLOW_ALLOW_FILE_STORE=true)

Which run: the active one (`mlflow.active_run()`, your own `mlflow.start_run()`), or the
`run_id` given, so nanguard's metrics sit next to yours and that run is left open; else a new
run, in the experiment `MLFLOW_EXPERIMENT_NAME` (default "nanguard") of the tracking store
MLflow itself would use (`MLFLOW_TRACKING_URI`, else its default), finished when the guard
closes. `write_run` with no run active and no `MLFLOW_TRACKING_URI` writes to `RUN/mlruns`;
so does `stream` where MLflow's default is a database this MLflow cannot open (MLflow 3
defaults to `sqlite:///mlflow.db`, which needs SQLAlchemy: the full `mlflow` package, not
`mlflow-skinny`, the `[mlflow]` extra), and it says so on the `nanguard` logger.

Written, per optimizer step (ranks of a merged folder as one MLflow run each):

- metrics `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are;
- metrics `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded);
- a tag per event, `nanguard.event.<step>.<kind>` (kind: alarms, actions, first_nonfinite,
  diagnosis, report; live also episodes) holding its markdown text, and at the end the run
  tags `nanguard.status`, `nanguard.first_nonfinite_step` / `_phase` / `_module` / `_op`,
  `nanguard.top_cause`;
- at the end the artifacts `nanguard/events.md` (every event under its step) and
  `nanguard/report.json`.

Live, each step is one `log_batch` (metrics and the step's event tags) as it is recorded.

What MLflow does with non-finite values: the file store keeps NaN and +-Inf; the database
store (sqlite, MySQL, PostgreSQL, hence a tracking server on one) keeps NaN but turns +-Inf
into +-1.7976931348623157e308; charts leave NaN out. The `nonfinite` series and the event tags
keep the step visible either way.

Needs `mlflow-skinny` (or `mlflow`; `pip install nanguard[mlflow]`); imported only when used.
The local file store is in maintenance mode in MLflow 3 and refuses to open unless
`MLFLOW_ALLOW_FILE_STORE=true`: the exporter sets it while it opens a `file:` URI (and
restores it after); a database URI needs the full `mlflow` package (SQLAlchemy, alembic).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.export.common import Event, Stream, load_run, run_parts, summary

if TYPE_CHECKING:
    from nanguard.guard import Guard

TAG_LIMIT = 5000
"""Longest tag value written (MLflow's own limit is 8000 characters); longer texts are cut."""


def write_run(run: str | Path, tracking_uri: str | None = None,
              experiment: str | None = None, run_name: str | None = None) -> list[str]:
    """Write a run folder's steps and events as MLflow runs (into the active run, if any).

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed), or a folder
            merged from ranks (`rank-R/` parts: one MLflow run each, named `<name>/rank-R`).
        tracking_uri: where to write a new run; default `MLFLOW_TRACKING_URI`, else the file
            store `RUN/mlruns`.
        experiment: experiment of a new run (created if missing); default
            `MLFLOW_EXPERIMENT_NAME`, else "nanguard".
        run_name: name of a new run; default the run folder's name.

    Returns:
        The MLflow run ids written, one per part.

    Raises:
        ValueError: `run` is not a nanguard run folder, or it has several parts and an MLflow
            run is active.
    """
    parts = run_parts(run)
    if tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        tracking_uri = (Path(run) / "mlruns").resolve().as_uri()
    name = run_name or Path(run).resolve().name
    ids = []
    for part, folder in parts:
        target = _Run(None, tracking_uri, experiment,
                      name if part is None else f"{name}/{part}", several=len(parts) > 1)
        data = load_run(folder)
        try:
            metrics = [(k, v, row.time, row.step) for row in data.steps
                       for k, v in row.scalars().items()]
            target.log(metrics, [(e.step, e.tag, e.text) for e in data.events])
        except BaseException:
            target.end(data.report, data.events, "FAILED")
            raise
        target.end(data.report, data.events)
        ids.append(target.run_id)
    return ids


def stream(guard: Guard, run_id: str | None = None, tracking_uri: str | None = None,
           experiment: str | None = None, run_name: str | None = None) -> MlflowStream:
    """Write the guard's steps and events to MLflow while it trains.

    Subscribes to the guard's step, event and close listeners: from the next recorded step
    on, each step's metrics and event tags are logged as it is recorded; the guard's
    `close()` writes the report (run tags, `nanguard/events.md`, `nanguard/report.json`) and
    ends the run if the stream started it.

    Args:
        guard: the guard to follow (not closed).
        run_id: an MLflow run to write into (left open); default the active run, else new.
        tracking_uri, experiment, run_name: for a new run (or `run_id`'s store); defaults:
            MLflow's own tracking URI (with mlflow-skinny and no `MLFLOW_TRACKING_URI`, the
            file store `RUN/mlruns`: see above), `MLFLOW_EXPERIMENT_NAME` or "nanguard", the
            run folder's name.

    Returns:
        The stream (`run_id` is the MLflow run; `close()` stops it early).

    Raises:
        ValueError: the guard is closed.
    """
    Stream.check(guard)
    name = run_name or (guard.folder.name if guard.folder is not None else None)
    fallback = (guard.folder if guard.folder is not None else Path(".")) / "mlruns"
    return MlflowStream(guard, _Run(run_id, tracking_uri, experiment, name, fallback=fallback))


# MLflow 3's default tracking URI is a SQLite database, which needs SQLAlchemy: the full
# `mlflow` package has it, `mlflow-skinny` (the `[mlflow]` extra) does not.
_DATABASES = ("sqlite:", "mysql", "postgresql", "mssql")


def default_uri(fallback: Path) -> tuple[str, bool]:
    """The tracking URI a new run goes to when none is given: MLflow's own (it honours
    MLFLOW_TRACKING_URI), unless that is MLflow's default database and this MLflow cannot
    open one (mlflow-skinny): then the file store `fallback`. Returns (uri, fell back)."""
    import importlib.util

    import mlflow

    uri = mlflow.get_tracking_uri()
    if (os.environ.get("MLFLOW_TRACKING_URI") or not uri.startswith(_DATABASES)
            or importlib.util.find_spec("sqlalchemy") is not None):
        return uri, False
    return fallback.resolve().as_uri(), True


class _Run:
    """The MLflow run written into: `run_id`, the active run (both left open), else a new
    one (ended by `end`)."""

    def __init__(self, run_id: str | None, uri: str | None, experiment: str | None,
                 name: str | None, several: bool = False, *,
                 fallback: Path = Path("mlruns")) -> None:
        import mlflow
        from mlflow.tracking import MlflowClient

        active = mlflow.active_run()
        if run_id is None and active is not None:
            if several:
                raise ValueError("a run of several ranks is one MLflow run each: call it with "
                                 "no MLflow run active, or pass one rank's folder")
            run_id, uri = active.info.run_id, mlflow.get_tracking_uri()
        if uri is None:
            uri, fell_back = default_uri(fallback)
            if fell_back:
                logging.getLogger("nanguard").warning(
                    "MLflow: mlflow-skinny cannot open MLflow's default database store; the "
                    "run goes to the file store %s (see it with MLFLOW_ALLOW_FILE_STORE=true "
                    "mlflow ui --backend-store-uri %s); set MLFLOW_TRACKING_URI to choose",
                    uri, uri)
        self.uri = uri
        with _file_store_allowed(uri):
            self.client = MlflowClient(tracking_uri=uri)
            self.owned = run_id is None
            if run_id is None:
                exp = experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "nanguard"
                found = self.client.get_experiment_by_name(exp)
                exp_id = found.experiment_id if found else self.client.create_experiment(exp)
                run_id = self.client.create_run(exp_id, run_name=name).info.run_id
            else:
                self.client.get_run(run_id)  # a wrong id fails here, not at the first step
        self.run_id = str(run_id)

    def log(self, metrics: list[tuple[str, float, float | None, int]],
            texts: list[tuple[int, str, str]]) -> None:
        """Metrics (key, value, time or None: now, step) and texts (step, tag, markdown)."""
        from mlflow.entities import Metric, RunTag

        now = time.time()
        batch = [Metric(k, v, int((t or now) * 1000), s) for k, v, t, s in metrics]
        tags = [RunTag(f"nanguard.event.{s}.{tag}", _cut(text)) for s, tag, text in texts]
        # MLflow takes at most 1000 metrics and 100 tags per batch
        for i in range(0, max(len(batch), len(tags) * 10), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000],
                                  tags=tags[i // 10:i // 10 + 100])

    def end(self, report: dict[str, Any] | None, events: list[Event],
            status: str = "FINISHED") -> None:
        from mlflow.entities import RunTag

        try:
            tags = [RunTag(f"nanguard.{k}", str(v)) for k, v in summary(report or {}).items()]
            if tags:
                self.client.log_batch(self.run_id, tags=tags)
            if events:
                self.client.log_text(self.run_id, "\n\n".join(
                    f"## step {e.step}: {e.tag}\n\n{e.text}" for e in events) + "\n",
                    "nanguard/events.md")
            if report:
                self.client.log_text(self.run_id, json.dumps(report, indent=1),
                                     "nanguard/report.json")
        finally:
            if self.owned:
                self.client.set_terminated(self.run_id, status=status)


class MlflowStream(Stream):
    """A guard streamed into an MLflow run (see `stream`)."""

    def __init__(self, guard: Guard, target: _Run) -> None:
        self.target = target
        self.run_id = target.run_id
        self.events: list[Event] = []
        super().__init__(guard)

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.target.log([(k, v, None, step) for k, v in scalars.items()],
                        [(step, tag, text) for tag, text in texts.items()])
        self.events += [Event(step, tag, text) for tag, text in texts.items()]

    def finish(self, report: dict[str, Any] | None) -> None:
        self.target.end(report, sorted(self.events, key=lambda e: e.step))


@contextlib.contextmanager
def _file_store_allowed(uri: str) -> Iterator[None]:
    # MLflow checks it once, when it opens the store for a URI (then kept for the process).
    key = "MLFLOW_ALLOW_FILE_STORE"
    if not uri.startswith("file:") and "://" in uri:
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


def _cut(text: str) -> str:
    return text if len(text) <= TAG_LIMIT else text[:TAG_LIMIT - 20] + "\n... (cut)"
