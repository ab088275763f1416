"""The step series of a run in the terminal: sparklines, the last steps as numbers, and the
alarms and actions as tables (the full summary, `nanguard report RUN --full`; the closing
summary shows sparklines only). Printed once a run has ended or when asked; nothing here runs
while training."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from nanguard.watch.stats import StepStats

_SPARK = "▁▂▃▄▅▆▇█"
SERIES = ("loss", "grad_norm", "act_max", "momentum_norm")
LAST = 24
"""How many steps the sparklines show."""


def sparkline(values: Sequence[float | None]) -> str:
    """Log-scaled sparkline; non-finite points show as '!' so they are never dropped."""
    logs = [math.log10(v) if v is not None and math.isfinite(v) and v > 0 else None for v in values]
    finite = [x for x in logs if x is not None]
    lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
    out = []
    for v, x in zip(values, logs, strict=True):
        if v is None:
            out.append(" ")
        elif not math.isfinite(v):
            out.append("!")
        elif x is None:
            out.append(_SPARK[0])
        else:
            out.append(_SPARK[int((x - lo) / (hi - lo + 1e-12) * (len(_SPARK) - 1))])
    return "".join(out)


def step_row(stats: StepStats) -> dict[str, float | None]:
    """The series the summary shows for one step."""
    return {
        "step": stats.step,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm,
        "act_max": stats.act_max,
        "momentum_norm": stats.momentum_norm,
        "headroom": stats.act_headroom,
    }


def steps_title(rows: Sequence[dict[str, Any]], first_step: int | None) -> str:
    """What the rows are, truthfully: the steps before the end, or (when the record keeps the
    steps up to the first non-finite value and the one after it, as the guard's history and
    `nanguard report` do) the steps up to the first non-finite value."""
    lo, hi = rows[0]["step"], rows[-1]["step"]
    span = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
    if first_step is not None and hi <= first_step + 1:
        return f"{span}, up to the first non-finite ({first_step})"
    return f"the last {len(rows)} steps ({lo}-{hi})" if lo != hi else f"the last step ({lo})"


def series_lines(rows: Sequence[dict[str, Any]], keys: Sequence[str] = SERIES) -> list[str]:
    """One sparkline per series that has values in `rows` (indented for the summary)."""
    out = []
    for key in keys:
        values = [r.get(key) for r in rows]
        if any(v is not None for v in values):
            out.append(f"    {key:<14}{sparkline(values)}")
    return out


def print_last_steps(console: Console, rows: Sequence[dict[str, float | None]],
                     first_step: int | None = None) -> None:
    """Sparklines of the last 24 steps, then the last 6 as numbers (non-finite kept, as '!').

    Args:
        console: where to print.
        rows: the steps (`step_row`), oldest first.
        first_step: the run's first non-finite step, so the title says when the rows stop
            there rather than at the end of the run.
    """
    last = list(rows)[-LAST:]
    if not last:
        return
    console.print(f"  {steps_title(last, first_step)}; log scale, ! = non-finite:",
                  markup=False, highlight=False)
    for line in series_lines(last):
        console.print(line, markup=False, highlight=False)
    table = Table(show_edge=False, box=None, padding=(0, 1))
    table.add_column("step", justify="right")
    # Headroom (decades left before the largest activation overflows its dtype) is a table
    # column only: it is already a logarithm.
    shown = [k for k in (*SERIES, "headroom") if any(r.get(k) is not None for r in last)]
    for key in shown:
        table.add_column(key, justify="right")
    for r in last[-6:]:
        table.add_row(str(r["step"]), *("-" if r.get(k) is None else f"{r[k]:.3g}" for k in shown))
    console.print(table)


def print_alarms(console: Console, report: Any) -> None:
    """The alarms as a table (of a failed run, those from the first warning to the first
    non-finite value: what led into it), then the actions, each list cut with its count."""
    first = report.first_nonfinite
    if report.alarms:
        table = Table(title="alarms", title_justify="left", show_edge=False)
        for col in ("step", "kind", "signal", "message"):
            table.add_column(col)
        alarms = report.alarms
        if first and report.first_warning is not None:
            alarms = [a for a in alarms if report.first_warning <= a["step"] <= first["step"]]
        shown = alarms[:12]
        for a in shown:
            table.add_row(str(a["step"]), a["kind"], a["signal"], a["message"])
        console.print(table)
        if len(report.alarms) > len(shown):
            console.print(f"  {len(shown)} of {len(report.alarms)} alarms shown; all are in "
                          "report.json", markup=False, highlight=False)
    for act in report.actions[:8]:
        part = f" ({act['part']})" if act.get("part") else ""
        console.print(f"  action at step {act['step']}{part}: {act['action']} — "
                      f"{act['detail']}", markup=False, highlight=False)
    if len(report.actions) > 8:
        console.print(f"  8 of {len(report.actions)} actions shown; all are in report.json",
                      markup=False, highlight=False)
