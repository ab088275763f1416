"""The terminal summary printed when a guarded run ends (and by `nanguard report`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from nanguard.record.report import Report
from nanguard.watch.stats import StepStats

_STATUS_STYLE = {"healthy": "green", "warned": "yellow", "failed": "red", "recovered": "cyan",
                 "crashed": "red", "degraded": "magenta", "unwatched": "magenta",
                 "interrupted": "yellow", "died": "red", "running": "blue"}
_SPARK = "▁▂▃▄▅▆▇█"


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


_STEPPED_OVER = {
    "GradScaler": "the GradScaler skipped that step: no update used it",
    "script": "no update used it: the step's loss, gradients and parameters stayed finite "
              "(the forward that held it was stepped over: your own non-finite check, or "
              "an evaluation pass)",
}
"""What `first_nonfinite.skipped_by` means for the run, said under the finding."""


def headline(report: Report) -> str:
    """`failed after 12 steps`; a failure before any update says so instead of reading like a
    crash (`failed: non-finite at step 0, before any update`)."""
    first = report.first_nonfinite
    if report.status == "failed" and first and report.steps == 0:
        return f"{report.status}: non-finite at step {first.get('step', 0)}, before any update"
    if report.status == "unwatched":
        return f"{report.status}: no training step was watched"
    if report.status == "running":
        seen = f", {len(report.alarms)} alarm(s) so far" if report.alarms else ""
        bad = "; non-finite values seen" if first else ""
        return f"running: {report.steps} step{'' if report.steps == 1 else 's'} recorded{seen}{bad}"
    return f"{report.status} after {report.steps} step{'' if report.steps == 1 else 's'}"


def print_summary(
    report: Report,
    history: Sequence[StepStats] = (),
    console: Console | None = None,
    *,
    parts_history: Mapping[str, Sequence[StepStats]] | None = None,
) -> None:
    """Print status, the first non-finite value (with its source line), alarms, actions and
    the last steps.

    Args:
        report: the report (a merged one for several optimizers or ranks).
        history: the steps of the part that failed (or of the only part).
        console: where to print; stderr by default.
        parts_history: for a merged report, each part's last steps by part label: one table
            per part instead of `history`.
    """
    console = console or Console(stderr=True)
    style = _STATUS_STYLE.get(report.status, "white")
    folder = report.run.get("folder")
    status, _, rest = headline(report).partition(report.status)
    console.print(
        f"[bold]nanguard[/]: {status}[{style}]{report.status}[/]{rest}"
        + (f" — record in {folder}" if folder else "")
    )
    first = report.first_nonfinite
    if first:
        where = ", ".join(
            f"{k} {first[k]}" for k in ("phase", "module", "op") if first.get(k) not in (None, "")
        )
        samples = first.get("samples") or []
        part = f" in {first['part']}" if first.get("part") else ""
        console.print(
            f"  [red]first non-finite[/] at step {first['step']}{part}"
            + (f" ({where})" if where else "")
            + (f", samples {samples[:8]}" if samples else "")
            + f"; in: {', '.join(first.get('signals') or []) or '?'}"
        )
        if first.get("source"):
            console.print(f"    at {first['source']}")
        if first.get("skipped_by") in _STEPPED_OVER:
            console.print(f"    {_STEPPED_OVER[first['skipped_by']]}")
    if report.first_warning is not None and first:
        console.print(
            f"  first warning at step {report.first_warning}: "
            f"[bold]{report.lead_steps}[/] steps before the first non-finite value"
        )
    for rank, cause in enumerate(report.diagnosis[:3], 1):
        console.print(f"  cause {rank}: [bold]{cause['cause']}[/] ({cause['confidence']:.0%})")
        console.print(f"    why: {cause['evidence']}")
        console.print(f"    fix: {cause['fix']}")
    line = report_spike_line(report)
    if line:
        console.print(f"  {line}")
    heal = heal_line(report)
    if heal:
        console.print(f"  {heal}")
    if report.alarms:
        table = Table(title="alarms", title_justify="left", show_edge=False)
        for col in ("step", "kind", "signal", "message"):
            table.add_column(col)
        alarms = report.alarms
        if first and report.first_warning is not None:
            # A failed run: the alarms that led into the failure matter most.
            alarms = [a for a in alarms if report.first_warning <= a["step"] <= first["step"]]
        shown = alarms[:12]
        for a in shown:
            table.add_row(str(a["step"]), a["kind"], a["signal"], a["message"])
        console.print(table)
        if len(report.alarms) > len(shown):
            console.print(f"  ... {len(report.alarms) - len(shown)} more in report.json")
    for act in report.actions[:8]:
        part = f" ({act['part']})" if act.get("part") else ""
        console.print(f"  action at step {act['step']}{part}: {act['action']} — "
                      f"{act['detail']}")
    if parts_history:
        info = report.run.get("parts") or {}
        for label, steps in parts_history.items():
            if not steps:
                continue
            what = info.get(label, {})
            desc = ", ".join(str(what[k]) for k in ("model", "optimizer") if what.get(k))
            console.print(f"  {label}" + (f" ({desc})" if desc else "") + ":")
            print_last_steps(console, [step_row(s) for s in steps])
    elif history:
        print_last_steps(console, [step_row(s) for s in history])


def report_spike_line(report: Report) -> str | None:
    """The report's spike line (`spike_line`), or None for a failed run whose only episode is
    its end: from the first non-finite value on every step is "in spike" by the measure's
    definition (a non-finite value counts as one), which says nothing the failure does not. A
    failed run with an earlier episode (it spiked before it broke) keeps the line."""
    m = report.spike_measures
    if report.status == "failed" and report.first_nonfinite is not None and m:
        episodes = m.get("episodes") or []
        if int(m.get("episodes_total") or 0) <= 1 and all(e.get("open") for e in episodes):
            return None
    return spike_line(m)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2g}%" if 0 < x < 0.01 else f"{100 * x:.1f}%"


def spike_line(m: dict[str, Any] | None) -> str | None:
    """One line of spike measures (`report.spike_measures`): `spikes: 3 episodes (1 open),
    1.2% of steps in spike; spike score loss 0.4%, grad norm 0.9%`; None without measures."""
    if not m or "score" not in m:
        return None
    n = int(m.get("episodes_total") or 0)
    opened = sum(bool(e.get("open")) for e in m.get("episodes") or [])
    scored = m.get("steps_scored") or {}
    # A score over a handful of steps says little: the count shows how many it rests on.
    score = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}"
                      + (f" of {scored[k]} steps" if isinstance(scored.get(k), int)
                         and scored[k] < 100 else "")
                      for k, v in m["score"].items() if v is not None)
    first = (m.get("episodes") or [{}])[0]
    lead = ""
    if first.get("before"):
        sig, b = max(first["before"].items(), key=lambda kv: _rank(kv[1].get("ratio")))
        lead = (f"; before the first: {sig.replace('_', ' ')} {_ratio(b.get('ratio'))} its "
                f"baseline {b.get('steps_before')} step(s) ahead")
    return (f"spikes: {n} episode{'' if n == 1 else 's'}" + (f" ({opened} open)" if opened
                                                               else "")
            + f", {_pct(m.get('time_in_spike'))} of steps in spike"
            + (f"; spike score {score}" if score else "")
            + ("" if m.get("complete", True) else " (not every step: see report.json)")
            + lead)


def heal_line(report: Report) -> str | None:
    """Under `heal`: what it did and what drove the spikes; else, on a run with a loss spike
    episode it came back from (heal's case: spikes that recover or run away, again and again;
    not a run whose one episode is its end in NaN), the recommendation to try it. None
    otherwise."""
    heal = (report.run.get("recovery") or {}).get("heal")
    if report.run.get("policy") == "heal":
        if not heal:
            return None
        cuts = heal.get("cuts") or []
        lrs = [c["lr"] for c in cuts if c.get("action") == "lr_cut" and c.get("lr")]
        factor = heal.get("lr_factor") or 1.0
        # Several cuts: the last cut's cause names the LR it cut, already lowered by the
        # earlier ones; say where the cuts began and how far they went in all.
        overall = (f" (LR cuts from lr {lrs[0]:.3g}: x{factor:.3g} of the scheduler's in all)"
                   if len(lrs) > 1 else "")
        # Steps lost: heal's clips lose none; a non-finite step it skipped is one.
        skipped = int((report.run.get("recovery") or {}).get("updates_skipped") or 0)
        lost = int(heal.get("steps_lost") or 0) + skipped
        cost = (f", {lost} step(s) lost" + (f" ({skipped} non-finite update(s) skipped)"
                                            if skipped else ""))
        if heal.get("seconds") and (heal.get("updates_clipped") or cuts):
            cost += f", {float(heal['seconds']) * 1e3:.3g} ms acting"
        return (f"heal: {heal.get('updates_clipped', 0)} spike precursor(s) clipped, "
                f"{len(cuts)} cut(s){cost}"
                + (f"; what drove the spikes: {heal['cause']}" if heal.get("cause") else "")
                + overall)
    m = report.spike_measures or {}
    if any(not e.get("open") for e in m.get("episodes") or []):
        return ("remedy: policy='heal' clips the grad-norm jump that comes before a loss spike "
                "and cuts the weight decay or the LR when the jumps recur")
    return None


def _rank(x: Any) -> float:
    if isinstance(x, (int, float)):
        return x if math.isfinite(x) else math.inf
    return math.inf if x in ("nan", "inf") else -math.inf


def _ratio(x: Any) -> str:
    return f"{x:.3g}x" if isinstance(x, (int, float)) and math.isfinite(x) else f"{x}x"


SERIES = ("loss", "grad_norm", "act_max", "momentum_norm")


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


def print_last_steps(console: Console, rows: Sequence[dict[str, float | None]]) -> None:
    """Sparklines of the last 24 steps, then the last 6 as numbers (non-finite kept, as '!')."""
    last = list(rows)[-24:]
    if not last:
        return
    console.print(f"  last {len(last)} steps before the end (log scale, ! = non-finite):")
    for key in SERIES:
        values = [r.get(key) for r in last]
        if any(v is not None for v in values):
            console.print(f"    {key:<14}{sparkline(values)}")
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
