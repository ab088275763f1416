"""trackio exporter: a run as a local trackio run, live while it trains or after the fact.

    from nanguard.export import trackio as ng_trackio
    ng_trackio.stream(guard)                 # live: into trackio's current run, else a new one
    ng_trackio.write_run("nanguard_runs/x", project="my-project")   # recorded: likewise
    # trackio show --project my-project

Which run: trackio's current one (your own `trackio.init`), left open, so nanguard's series sit
next to yours; else a new run (finished when the guard closes, or after `write_run`), which
is not made trackio's current run: your later `trackio.log` calls do not land in it.

Written, per optimizer step (ranks of a merged folder as one run each):

- `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are (trackio stores them
  as "NaN" / "Infinity" and reads them back as floats; its plots cannot draw them);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite, so plotted;
- a trackio alert per event at its step (alarms: WARN; actions: INFO; first non-finite value and
  diagnosis: ERROR; the closing report: INFO, or ERROR unless the run ended well), title
  `nanguard <kind>`, the markdown text as the alert's text;
- `nanguard/events` (a trackio Markdown) at each step with an event, and (a new run of
  `write_run` only: trackio fixes a run's config when it starts) the run's config
  `nanguard/status`, `nanguard/first_nonfinite_step` / `_phase` / `_module` / `_op`,
  `nanguard/top_cause`. Live, an event told after its step (the finding, at close) is logged
  at its own step, which trackio takes out of order.

trackio keeps its local store in `TRACKIO_DIR` (default `~/.cache/huggingface/trackio`), read
once when trackio is first imported: pass `dir=` on the first use in a process, or set the
environment variable before.

Needs `trackio` (`pip install nanguard[trackio]`); imported only when used.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.export.common import Stream, load_run, run_parts, summary

if TYPE_CHECKING:
    from nanguard.guard import Guard

GOOD = ("healthy", "warned", "recovered")
"""Report statuses after which the closing report's alert is INFO rather than ERROR."""


def write_run(run: str | Path, project: str = "nanguard", name: str | None = None,
              dir: str | Path | None = None) -> list[str]:
    """Write a run folder's steps and events as trackio runs.

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed), or a folder
            merged from ranks (`rank-R/` parts: one trackio run each, named `<name>/rank-R`).
        project: trackio project.
        name: trackio run name; default the run folder's name.
        dir: trackio's local store (`TRACKIO_DIR`); default trackio's own. Only before trackio
            is first imported in this process.

    Returns:
        The trackio run names written, one per part (the current run's, when one is active).

    Raises:
        ValueError: `run` is not a nanguard run folder, `dir` differs from the store of a
            trackio imported earlier in this process, or `run` has several parts and a trackio
            run is current.
    """
    parts = run_parts(run)
    trackio = _import(dir)
    if trackio.context_vars.current_run.get() is not None and len(parts) > 1:
        raise ValueError(f"{run} holds {len(parts)} ranks, one trackio run each: call it with "
                         "no trackio run current, or pass one rank's folder")
    base = name or Path(run).resolve().name
    names = []
    for part, folder in parts:
        data = load_run(folder)
        target = _Run(trackio, project, base if part is None else f"{base}/{part}",
                      {f"nanguard/{k}": v for k, v in summary(data.report).items()})
        try:
            texts: dict[int, dict[str, str]] = {}
            for e in data.events:
                texts.setdefault(e.step, {})[e.tag] = e.text
            rows = {row.step: row.scalars() for row in data.steps}
            for step in sorted(set(rows) | set(texts)):
                target.log(step, rows.get(step, {}), texts.get(step, {}), data.report)
        finally:
            target.end()
        names.append(target.name)
    return names


def stream(guard: Guard, project: str = "nanguard", name: str | None = None,
           dir: str | Path | None = None) -> TrackioStream:
    """Write the guard's steps and events to trackio while it trains.

    Subscribes to the guard's step, event and close listeners: from the next recorded step
    on, each step's values are logged at the guard's step and each event is an alert and a
    Markdown at its step; the guard's `close()` logs the report and finishes the run if the
    stream started it (trackio's current run, when there is one, is used and left open).

    Args:
        guard: the guard to follow (not closed).
        project, name, dir: for a new run: trackio project, run name (default the guard's
            run folder's name), local store (as in `write_run`).

    Returns:
        The stream (`run` is the trackio run; `close()` stops it early).

    Raises:
        ValueError: the guard is closed, or `dir` as in `write_run`.
    """
    Stream.check(guard)
    trackio = _import(dir)
    name = name or (guard.folder.name if guard.folder is not None else None)
    return TrackioStream(guard, _Run(trackio, project, name, {}))


def _import(dir: str | Path | None) -> Any:
    if dir is None:
        import trackio

        return trackio
    want = Path(dir).resolve()
    if "trackio" in sys.modules:
        from trackio import utils

        if Path(utils.TRACKIO_DIR).resolve() != want:
            raise ValueError(f"trackio was imported with its store at {utils.TRACKIO_DIR}; "
                             f"set TRACKIO_DIR={want} before trackio is imported")
        return sys.modules["trackio"]
    before = os.environ.get("TRACKIO_DIR")
    os.environ["TRACKIO_DIR"] = str(want)
    try:
        import trackio
    finally:
        if before is None:
            del os.environ["TRACKIO_DIR"]
        else:
            os.environ["TRACKIO_DIR"] = before
    return trackio


def _level(trackio: Any, tag: str, status: Any) -> Any:
    levels = trackio.AlertLevel
    if tag == "alarms":
        return levels.WARN
    if tag in ("first_nonfinite", "diagnosis"):
        return levels.ERROR
    if tag == "report" and status not in GOOD:
        return levels.ERROR
    return levels.INFO


class _Run:
    """The trackio run written into: trackio's current run (left open), else a new one."""

    def __init__(self, trackio: Any, project: str, name: str | None,
                 config: dict[str, Any]) -> None:
        self.trackio = trackio
        current = trackio.context_vars.current_run
        self.run = current.get()
        self.owned = self.run is None
        if self.run is None:
            self.run = trackio.init(project=project, name=name, config=config, embed=False,
                                    auto_log_gpu=False, auto_log_cpu=False)
            # trackio.init makes it the current run: the user's `trackio.log` would land in it
            current.set(None)
        self.name = str(self.run.name)

    def log(self, step: int, scalars: dict[str, Any], texts: dict[str, str],
            report: dict[str, Any] | None = None) -> None:
        row: dict[str, Any] = dict(scalars)
        if texts:
            row["nanguard/events"] = self.trackio.Markdown("\n\n".join(
                f"### {tag}\n\n{text}" for tag, text in texts.items()))
        self.run.log(row, step=step)
        status = (report or {}).get("status")
        for tag, text in texts.items():
            self.run.alert(title=f"nanguard {tag}", text=text,
                           level=_level(self.trackio, tag, status), step=step)

    def end(self) -> None:
        if self.owned:
            self.run.finish()


class TrackioStream(Stream):
    """A guard streamed into a trackio run (see `stream`)."""

    def __init__(self, guard: Guard, target: _Run) -> None:
        self.target = target
        self.run = target.run
        self.report: dict[str, Any] | None = None
        super().__init__(guard)

    def _on_close(self, event: Any) -> None:
        self.report = event.data  # the closing report's alert level follows its status
        super()._on_close(event)

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.target.log(step, scalars, texts, self.report)

    def finish(self, report: dict[str, Any] | None) -> None:
        self.target.end()
