"""trackio exporter: a recorded run (run.db + report.json) as a local trackio run.

    from nanguard.export.trackio import write_run
    write_run("nanguard_runs/x", project="my-project")   # -> trackio's local store
    # trackio show --project my-project

Written, per optimizer step (one trackio run; ranks of a merged folder as one run each):

- `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are (trackio stores them
  as "NaN" / "Infinity" and reads them back as floats; its plots cannot draw them);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite, so plotted;
- a trackio alert per event at its step (alarms: WARN; actions: INFO; first non-finite value and
  diagnosis: ERROR; the closing report: INFO, or ERROR unless the run ended well), title
  `nanguard <kind>`, the markdown text as the alert's text;
- `nanguard/events` (a trackio Markdown) at each step with an event, and the run's config
  `nanguard/status`, `nanguard/first_nonfinite_step` / `_phase` / `_module` / `_op`,
  `nanguard/top_cause`.

trackio keeps its local store in `TRACKIO_DIR` (default `~/.cache/huggingface/trackio`), read
once when trackio is first imported: pass `dir=` on the first use in a process, or set the
environment variable before.

Needs `trackio` (`pip install nanguard[trackio]`); imported only when used.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from nanguard.export._common import RunData, load_run, run_parts, summary

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
        The trackio run names written, one per part.

    Raises:
        ValueError: `run` is not a nanguard run folder, or `dir` differs from the store of a
            trackio imported earlier in this process.
    """
    parts = run_parts(run)
    trackio = _import(dir)
    base = name or Path(run).resolve().name
    names = []
    for part, folder in parts:
        names.append(_write_one(trackio, load_run(folder), project,
                                base if part is None else f"{base}/{part}"))
    return names


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


def _write_one(trackio: Any, data: RunData, project: str, name: str) -> str:
    facts = {f"nanguard/{k}": v for k, v in summary(data.report).items()}
    run = trackio.init(project=project, name=name, config=facts, embed=False,
                       auto_log_gpu=False, auto_log_cpu=False)
    try:
        rows: dict[int, dict[str, Any]] = {}
        for row in data.steps:
            rows[row.step] = row.scalars()
        texts: dict[int, list[str]] = {}
        for e in data.events:
            texts.setdefault(e.step, []).append(f"### {e.tag}\n\n{e.text}")
        for step, parts in texts.items():
            rows.setdefault(step, {})["nanguard/events"] = trackio.Markdown("\n\n".join(parts))
        for step in sorted(rows):
            run.log(rows[step], step=step)
        status = data.report.get("status")
        for e in data.events:
            run.alert(title=f"nanguard {e.tag}", text=e.text,
                      level=_level(trackio, e.tag, status), step=e.step)
    finally:
        run.finish()
    return str(run.name)
