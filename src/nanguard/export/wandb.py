"""Weights & Biases exporter: a run as W&B history, live while it trains or after the fact.

    from nanguard.export import wandb as ng_wandb
    ng_wandb.stream(guard)                       # live: into `wandb.run`, else a new run
    ng_wandb.write_run("nanguard_runs/x")        # recorded: the same, from run.db + report.json
    # WANDB_MODE=offline -> RUN/wandb/offline-run-*; `wandb sync` uploads it later

Which run: the active one (`wandb.run`, your own `wandb.init`), so nanguard's series sit next
to yours; else a new run, made the way `wandb.init` makes one: `WANDB_PROJECT` (default
"nanguard"), `WANDB_MODE` and `WANDB_DIR` (default the nanguard run folder) are honoured unless
arguments say otherwise. A run nanguard opened is finished when the guard closes (or after
`write_run`); yours is left open.

Written, per optimizer step (one W&B row each; ranks of a merged folder as one run each):

- `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are (W&B stores them as
  "NaN" / "Infinity"; its line plots drop those points, leaving no trace of the step);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite, so plotted;
- `nanguard/step`, the guard's step: the x-axis of every `nanguard/*` chart (`define_metric`).
  Rows are logged without `step=`, as W&B asks of integrations sharing a run, so your own
  `wandb.log` calls keep working; W&B's `_step` then counts rows, not optimizer steps (code
  that passes its own `step=` to `wandb.log` should log a `step` of its own metric instead);
- `nanguard/events` (an HTML panel) in the row of each step with an event: the alarms,
  actions, first non-finite value, diagnosis and closing report of that step, as text (an
  event told after its step, like the finding at close, in a row of its own);
- at the end `nanguard/event_table` (step, kind, text) and the run summary
  `nanguard/status`, `nanguard/first_nonfinite_step` / `_phase` / `_module` / `_op`,
  `nanguard/top_cause`; live, a W&B alert (`run.alert`, kept with an offline run) for the
  first alarm of a non-finite value and for the finding (`alerts=False`: none).

Needs `wandb` (`pip install nanguard[wandb]`); imported only when used.
"""

from __future__ import annotations

import html
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.export.common import RunData, Stream, load_run, run_parts, summary

if TYPE_CHECKING:
    from nanguard.guard import Guard
    from nanguard.record.events import Event as LiveEvent


def write_run(run: str | Path, project: str | None = None, name: str | None = None,
              mode: str | None = None, dir: str | Path | None = None) -> list[Path]:
    """Write a run folder's steps and events as W&B runs (into `wandb.run` when one is active).

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed), or a folder
            merged from ranks (`rank-R/` parts: one W&B run each, named `<name>/rank-R`).
        project: W&B project of a new run; default `WANDB_PROJECT`, else "nanguard".
        name: W&B name of a new run; default the run folder's name.
        mode: "online", "offline" or "disabled"; default W&B's own (`WANDB_MODE`, else online).
        dir: where W&B keeps a new run's local files (the `wandb/` folder); default
            `WANDB_DIR`, else the run folder.

    Returns:
        The W&B local run folders written (`.../wandb/offline-run-*` or `.../run-*`).

    Raises:
        ValueError: `run` is not a nanguard run folder, or it has several parts and a W&B run
            is active (a part each needs a run of its own).
    """
    parts = run_parts(run)
    base = name or Path(run).resolve().name
    import wandb

    if wandb.run is not None and len(parts) > 1:
        raise ValueError(f"{run} holds {len(parts)} ranks, one W&B run each: call it with no "
                         "W&B run active, or pass one rank's folder")
    out = []
    for part, folder in parts:
        wb = _Run(project, base if part is None else f"{base}/{part}", mode, dir, Path(run))
        data = load_run(folder)
        try:
            _write_one(wb, data)
        except BaseException:
            wb.end(exit_code=1)
            raise
        wb.end(data.report)
        out.append(wb.folder)
    return out


def stream(guard: Guard, project: str | None = None, name: str | None = None,
           mode: str | None = None, dir: str | Path | None = None,
           alerts: bool = True) -> WandbStream:
    """Write the guard's steps and events to W&B while it trains.

    Subscribes to the guard's step, event and close listeners: from the next recorded step
    on, each step is a row of `nanguard/*` values and each event a text panel, logged as it
    happens; the guard's `close()` logs the report, sets the run summary and finishes the run
    if the stream started it (`wandb.run`, when active, is used and left open).

    Args:
        guard: the guard to follow (not closed).
        project, name, mode, dir: for a new run only, as in `write_run` (default `dir`:
            `WANDB_DIR`, else the guard's run folder, else W&B's own).
        alerts: raise a W&B alert for the first non-finite alarm and for the finding.

    Returns:
        The stream (`run` is the W&B run; `close()` stops it early).

    Raises:
        ValueError: the guard is closed.
    """
    Stream.check(guard)
    where = guard.folder if guard.folder is not None else Path.cwd()
    return WandbStream(guard, _Run(project, name or where.name, mode, dir, where), alerts)


class _Run:
    """The W&B run written into: `wandb.run` if active (left open), else a new one."""

    def __init__(self, project: str | None, name: str, mode: str | None,
                 dir: str | Path | None, home: Path) -> None:
        import wandb

        self.wandb = wandb
        active = wandb.run
        self.owned = active is None
        if active is None:
            # Read here, not left to wandb.init: W&B reads its environment once per process
            # (at its first run), so a later WANDB_DIR / _PROJECT / _MODE would go unseen.
            env = os.environ
            where = Path(dir or env.get("WANDB_DIR") or home)
            where.mkdir(parents=True, exist_ok=True)
            settings = wandb.Settings(console="off", save_code=False, x_disable_stats=True,
                                      silent=True)
            options: dict[str, Any] = {"mode": mode or env.get("WANDB_MODE") or None}
            self.run = wandb.init(
                project=project or env.get("WANDB_PROJECT") or "nanguard", name=name,
                dir=str(where), settings=settings, reinit="create_new",
                config={"nanguard": True}, **options)
        else:
            self.run = active
        self.run.define_metric("nanguard/step")
        self.run.define_metric("nanguard/*", step_metric="nanguard/step")
        self.events: list[list[Any]] = []  # (step, kind, text) of every text logged

    @property
    def folder(self) -> Path:
        return Path(self.run.dir).parent

    def log(self, step: int, scalars: dict[str, Any], texts: dict[str, str]) -> None:
        row: dict[str, Any] = {**scalars, "nanguard/step": step}
        if texts:
            parts = "".join(f"<h3>{tag}</h3><pre>{html.escape(text)}</pre>"
                            for tag, text in texts.items())
            row["nanguard/events"] = self.wandb.Html(f"<h2>nanguard, step {step}</h2>{parts}",
                                                     inject=False)
            self.events += [[step, tag, text] for tag, text in texts.items()]
        self.run.log(row)

    def end(self, report: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if self.events:
            self.run.log({"nanguard/event_table": self.wandb.Table(
                columns=["step", "kind", "text"], data=self.events)})
        for key, value in summary(report or {}).items():
            self.run.summary[f"nanguard/{key}"] = value
        if self.owned:
            self.run.finish(exit_code=exit_code)


def _write_one(wb: _Run, data: RunData) -> None:
    texts: dict[int, dict[str, str]] = {}
    for e in data.events:
        texts.setdefault(e.step, {})[e.tag] = e.text
    rows = {row.step: row.scalars() for row in data.steps}
    for step in sorted(set(rows) | set(texts)):
        wb.log(step, rows.get(step, {}), texts.get(step, {}))


class WandbStream(Stream):
    """A guard streamed into a W&B run (see `stream`)."""

    def __init__(self, guard: Guard, wb: _Run, alerts: bool) -> None:
        self.wb = wb
        self.run = wb.run
        self.alerts = alerts
        self._alerted: set[str] = set()
        super().__init__(guard)
        if alerts:
            guard.add_listener(self._alert)

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        self.wb.log(step, scalars, texts)

    def finish(self, report: dict[str, Any] | None) -> None:
        self.wb.end(report)

    def _alert(self, event: LiveEvent) -> None:
        # One alert per kind of news: W&B mails or pages on each, and a NaN alarms every step.
        what = "finding" if event.type == "finding" else event.kind
        if self.closed or what in self._alerted or what not in ("nonfinite", "finding"):
            return
        if event.type not in ("alarm", "finding"):
            return
        self._alerted.add(what)
        level = self.wb.wandb.AlertLevel.ERROR
        self.run.alert(title=f"nanguard: {what} at step {event.step}", text=event.message,
                       level=level)
