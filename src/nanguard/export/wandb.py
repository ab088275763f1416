"""Weights & Biases exporter: a recorded run (run.db + report.json) as a W&B run.

    from nanguard.export.wandb import write_run
    write_run("nanguard_runs/x", mode="offline")      # -> nanguard_runs/x/wandb/offline-run-*
    # wandb sync nanguard_runs/x/wandb/offline-run-*   (upload later)
    write_run("nanguard_runs/x", project="my-project")   # online, where wandb is logged in

Written, per optimizer step (one W&B run; ranks of a merged folder as one run each):

- `nanguard/<signal>` (loss, grad_norm, ...) with NaN and +-Inf as they are (W&B stores them as
  "NaN" / "Infinity"; its line plots drop those points, leaving no trace of the step);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite, so plotted;
- `nanguard/events` (an HTML panel) at each step with an event: the alarms, actions, first
  non-finite value, diagnosis and closing report of that step, as text;
- `nanguard/event_table` (a table: step, kind, text) at the last step, and the run summary
  `nanguard/status`, `nanguard/first_nonfinite_step` / `_phase` / `_module` / `_op`,
  `nanguard/top_cause`.

Needs `wandb` (`pip install nanguard[wandb]`); imported only when used.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from nanguard.export._common import RunData, load_run, run_parts, summary


def write_run(run: str | Path, project: str = "nanguard", name: str | None = None,
              mode: str | None = None, dir: str | Path | None = None) -> list[Path]:
    """Write a run folder's steps and events as W&B runs.

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed), or a folder
            merged from ranks (`rank-R/` parts: one W&B run each, named `<name>/rank-R`).
        project: W&B project.
        name: W&B run name; default the run folder's name.
        mode: "online", "offline" or "disabled"; default W&B's own (`WANDB_MODE`, else online).
        dir: where W&B keeps its local files (the `wandb/` folder); default the run folder.

    Returns:
        The W&B local run folders written (`.../wandb/offline-run-*` or `.../run-*`).

    Raises:
        ValueError: `run` is not a nanguard run folder.
    """
    parts = run_parts(run)
    base = name or Path(run).resolve().name
    where = Path(dir) if dir is not None else Path(run)
    where.mkdir(parents=True, exist_ok=True)
    return [_write_one(load_run(folder), project, base if part is None else f"{base}/{part}",
                       mode, where)
            for part, folder in parts]


def _write_one(data: RunData, project: str, name: str, mode: str | None, where: Path) -> Path:
    import wandb

    settings = wandb.Settings(console="off", save_code=False, x_disable_stats=True,
                              silent=True)
    options: dict[str, Any] = {"mode": mode}  # a plain str here; wandb types it as a Literal
    run = wandb.init(project=project, name=name, dir=str(where), settings=settings,
                     reinit="create_new", config={"nanguard": True}, **options)
    exit_code = 0
    try:
        texts: dict[int, list[str]] = {}
        for e in data.events:
            texts.setdefault(e.step, []).append(f"<h3>{e.tag}</h3><pre>{html.escape(e.text)}</pre>")
        rows: dict[int, dict[str, Any]] = {}
        for row in data.steps:
            rows[row.step] = row.scalars()
        for step, parts in texts.items():
            rows.setdefault(step, {})["nanguard/events"] = wandb.Html(
                f"<h2>nanguard, step {step}</h2>" + "".join(parts), inject=False)
        last = max(rows, default=0)
        if data.events:
            rows.setdefault(last, {})["nanguard/event_table"] = wandb.Table(
                columns=["step", "kind", "text"],
                data=[[e.step, e.tag, e.text] for e in data.events])
        for step in sorted(rows):
            run.log(rows[step], step=step)
        for key, value in summary(data.report).items():
            run.summary[f"nanguard/{key}"] = value
    except BaseException:
        exit_code = 1
        raise
    finally:
        run.finish(exit_code=exit_code)
    return Path(run.dir).parent
