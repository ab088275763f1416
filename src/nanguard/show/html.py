"""The HTML report: one self-contained page (Plotly's JavaScript inlined, nothing fetched).

On top the finding: status, the first non-finite value and the ranked diagnosis with its fix.
Below, linked plots over steps sharing one x axis (zoom one, all follow): events (alarms,
actions, the first non-finite value), loss, global grad norm, per-layer grad norm heat map,
activation abs-max, optimizer-state norms, update ratio and LR. Alarm steps, actions and the
first non-finite step are drawn as vertical lines across every plot; non-finite values are
drawn as red markers, never dropped. Several runs (`nanguard report A B --html F`) or the
parts of a merged run (several optimizers or ranks) give one trace each.

Long runs are downsampled per bucket of steps (`nanguard.show.series`): the page stays small
and a non-finite step is never averaged away.

The page needs the optional `html` extra (`pip install nanguard[html]`): Plotly, whose
JavaScript ships inside its PyPI package and is copied into every page.
"""

from __future__ import annotations

import html
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nanguard.record.report import OK_STATUSES, REPORT_NAME, Report, load_report
from nanguard.record.store import DB_NAME
from nanguard.show.series import Buckets, RunSeries, bucket_width, load_series, step_range

LINE_BUCKETS = 1000
"""At most this many buckets per line series."""
HEAT_BUCKETS = 400
"""At most this many buckets (columns) in a per-layer heat map."""
MAX_HEATMAPS = 4
"""Heat maps drawn at most (one per run or part)."""
MAX_EVENT_LINES = 300
"""Vertical alarm / action lines drawn at most (the earliest ones)."""
LABEL_CHARS = 40
"""Layer names on the heat map's axis are shortened to this many characters."""

COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
          "#7f7f7f")
BAD = "#d62728"
_STATUS_COLOR = {"healthy": "#2ca02c", "warned": "#bcbd22", "recovered": "#17becf",
                 "running": "#1f77b4"}


@dataclass
class Source:
    """One run as given on the command line: its report and the stores to plot."""

    label: str
    folder: str
    report: Report
    parts: list[tuple[str, str]]
    """(trace label, folder holding run.db): the run itself, or each part of a merged run."""


def plotly_js() -> str:
    """Plotly's bundled JavaScript (from the plotly package: nothing is fetched)."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ValueError(
            "the HTML report needs plotly: pip install 'nanguard[html]'"
        ) from None
    return str(get_plotlyjs())


def live_report(folder: str | os.PathLike[str]) -> Report:
    """The run's report.json, or for a run still training (no report.json yet) a report
    read from run.db through a read-only connection (status `running`)."""
    path = Path(folder)
    if (path / REPORT_NAME).is_file() or not (path / DB_NAME).is_file():
        return load_report(path)
    series = load_series(path, path.name, width=1 << 62)
    first = series.findings[0] if series.findings else None
    if first is None:
        bad = [a for a in series.alarms if a["kind"] == "nonfinite"]
        if bad:
            first = {"step": bad[0]["step"], "signals": sorted({a["signal"] for a in bad
                                                               if a["step"] == bad[0]["step"]})}
    steps = 0 if series.last_step < 0 else series.last_step - series.first_step + 1
    return Report(status="running", steps=steps, alarms=series.alarms, actions=series.actions,
                  first_nonfinite=first, run={"folder": str(path), "closed": False})


def run_parts(folder: str, report: Report, label: str) -> list[tuple[str, str]]:
    """The stores to plot for a run: its own run.db, or each part of a merged run
    (`run.parts`, see `nanguard.integrations.merge`) that has one."""
    if (Path(folder) / DB_NAME).is_file():
        return [(label, folder)]
    out = []
    for part, info in (report.run.get("parts") or {}).items():
        cand = [(info or {}).get("folder"), str(Path(folder) / part)]
        found = next((c for c in cand if c and (Path(c) / DB_NAME).is_file()), None)
        if found:
            out.append((f"{label}/{part}", found))
    return out


def load_sources(runs: Sequence[str], *, live: bool = False) -> list[Source]:
    """Reports and stores of the runs to show.

    Raises:
        ValueError: one line, for a path that is not a run folder or an unreadable report.
    """
    names = [Path(r).resolve().name or str(r) for r in runs]
    dup = len(set(names)) < len(names)
    out = []
    for run, name in zip(runs, names, strict=True):
        if not Path(run).is_dir():
            raise ValueError(f"{run!r} is not a nanguard run folder")
        report = live_report(run) if live else load_report(run)
        label = str(run) if dup else name
        out.append(Source(label, str(run), report, run_parts(str(run), report, label)))
    return out


# --------------------------------------------------------------------------- figure


def _num(a: np.ndarray | Sequence[float], digits: int = 5) -> list[float | None]:
    """JSON-ready numbers (non-finite -> null, `digits` significant digits)."""
    return [float(f"{x:.{digits}g}") if math.isfinite(x) else None for x in map(float, a)]


def _bad_markers(b: Buckets) -> tuple[list[int], list[float], list[str],
                                      list[int | None], list[float | None]]:
    """Where to draw the non-finite values of a series. Consecutive buckets holding one are
    a run: a marker at the run's first non-finite step, at the height of the largest finite
    value of that bucket (or the nearest finite value before it), and a red segment at that
    height over the rest of the run (one marker per bucket would be hundreds of identical
    crosses for a series that stays NaN, and slow to draw). Every non-finite bucket is
    covered by its run's marker or segment.

    Returns:
        marker x, y and hover text; segment x and y (runs separated by None).
    """
    has = np.flatnonzero(b.nonfinite > 0)
    if len(has) == 0:
        return [], [], [], [], []
    level = np.where(np.isfinite(b.last), b.last, b.hi)
    finite = np.isfinite(level)
    fallback = float(np.nanmax(np.where(finite, level, np.nan))) if finite.any() else 1.0
    idx = np.where(finite, np.arange(len(level)), -1)
    idx = np.maximum.accumulate(idx)
    starts = has[np.r_[True, np.diff(has) > 1]]
    ends = has[np.r_[np.diff(has) > 1, True]]
    xs, ys, texts = [], [], []
    seg_x: list[int | None] = []
    seg_y: list[float | None] = []
    for i, e in zip(starts, ends, strict=True):
        j = idx[i - 1] if i > 0 else -1
        if math.isfinite(b.hi[i]):
            y = float(b.hi[i])
        elif j >= 0:
            y = float(level[j])
        else:
            y = fallback
        y = y if y > 0 else 1.0
        v = float(b.bad_value[i])
        x0 = int(b.bad_step[i])
        xs.append(x0)
        ys.append(y)
        n = int(b.nonfinite[i:e + 1].sum())
        last = int(b.step[e + 1]) - 1 if e + 1 < len(b) else None
        span = f"steps {int(b.step[i])}..{'' if last is None else last}"
        texts.append(f"{'nan' if math.isnan(v) else v} at step {x0}"
                     + (f" ({n} non-finite in {span})" if n > 1 else ""))
        if e > i:
            seg_x += [x0, int(b.bad_step[e]), None]
            seg_y += [y, y, None]
    return xs, ys, texts, seg_x, seg_y


class _Fig:
    """Collects the traces of a stacked-subplot Plotly figure with one shared x axis."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.data: list[dict[str, Any]] = []
        self.legend_seen: set[str] = set()
        self.left = 75
        """Left margin in pixels (widened for the heat maps' layer names)."""

    def row(self, title: str, *, height: float = 1.0, log: bool = False,
            category: bool = False, fixed: bool = False,
            axis: dict[str, Any] | None = None) -> str:
        """Add a subplot; returns its axis suffix ('', '2', ...). `axis`: more properties of
        its y axis."""
        self.rows.append({"title": title, "height": height, "log": log, "cat": category,
                          "fixed": fixed, "colorbars": [], "axis": axis or {}})
        n = len(self.rows)
        return "" if n == 1 else str(n)

    def add(self, ax: str, trace: dict[str, Any], legend: str | None = None) -> None:
        trace = {"xaxis": f"x{ax}", "yaxis": f"y{ax}", **trace}
        if legend is not None:
            trace["legendgroup"] = legend
            trace["name"] = trace.get("name", legend)
            trace["showlegend"] = legend not in self.legend_seen
            self.legend_seen.add(legend)
        self.data.append(trace)

    def layout(self, shapes: list[dict[str, Any]]) -> dict[str, Any]:
        total = sum(r["height"] for r in self.rows)
        gap = 0.025
        usable = 1.0 - gap * (len(self.rows) - 1)
        lay: dict[str, Any] = {
            "height": int(70 + 190 * total),
            # Fixed margins (no automargin: it costs Plotly a second full layout pass, a third
            # of the render time of a long run's page); wide enough for the y tick labels.
            "margin": {"l": self.left, "r": 30, "t": 50, "b": 45},
            "hovermode": "closest",
            "uirevision": "keep",
            "legend": {"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0.3},
            "shapes": shapes,
            "annotations": [],
            "plot_bgcolor": "#fafafa",
        }
        top = 1.0
        for i, r in enumerate(self.rows, 1):
            h = usable * r["height"] / total
            s = "" if i == 1 else str(i)
            lay[f"yaxis{s}"] = {
                "domain": [max(0.0, top - h), top],
                "type": "category" if r["cat"] else ("log" if r["log"] else "linear"),
                "exponentformat": "e" if r["log"] else "B",
                "fixedrange": r["fixed"], "ticklabeloverflow": "allow",
                # Linear rows include 0 (a constant LR is not drawn mid-way in -1..1).
                **({} if r["cat"] or r["log"] else {"rangemode": "tozero"}),
                **r["axis"],
            }
            for bar in r["colorbars"]:
                bar["y"] = top - h / 2
                bar["len"] = max(0.05, h * 0.95)
            lay[f"xaxis{s}"] = {
                # Fixed angle, no overflow check: Plotly then measures fewer labels.
                "anchor": f"y{s}", "showticklabels": True, "showspikes": True,
                "tickangle": 0, "ticklabeloverflow": "allow",
                "spikemode": "across", "spikethickness": 1, **({"matches": "x"} if i > 1 else {}),
            }
            lay["annotations"].append({
                "text": f"<b>{html.escape(r['title'])}</b>", "xref": "paper",
                "yref": "paper", "x": 0, "y": top, "xanchor": "left", "yanchor": "bottom",
                "showarrow": False, "font": {"size": 12},
            })
            top -= h + gap
        return lay


def _line(fig: _Fig, ax: str, b: Buckets, name: str, color: str, legend: str,
          dash: str = "solid", bad_level: float | None = None) -> None:
    """A bucketed series: its min..max band (when downsampled), last value and non-finite
    markers."""
    x = b.step.tolist()
    if len(b) and bool(np.any(np.nan_to_num(b.hi - b.lo) > 0)):
        fig.add(ax, {"type": "scatter", "mode": "lines", "x": x, "y": _num(b.lo),
                     "line": {"width": 0, "color": color}, "hoverinfo": "skip",
                     "showlegend": False, "name": f"{name} min"})
        fig.add(ax, {"type": "scatter", "mode": "lines", "x": x, "y": _num(b.hi),
                     "fill": "tonexty", "line": {"width": 0, "color": color},
                     "opacity": 0.25, "hoverinfo": "skip", "showlegend": False,
                     "name": f"{name} max"})
    fig.add(ax, {"type": "scatter", "mode": "lines", "x": x, "y": _num(b.last),
                 "line": {"width": 1.5, "color": color, "dash": dash}, "name": name,
                 "hovertemplate": f"{html.escape(name)}<br>step %{{x}}: %{{y:.4g}}"
                                  "<extra></extra>"}, legend)
    xs, ys, texts, seg_x, seg_y = _bad_markers(b)
    if bad_level is not None:  # e.g. headroom: a non-finite value sits at 0 decades left
        ys = [bad_level] * len(ys)
        seg_y = [None if y is None else bad_level for y in seg_y]
    if xs:
        fig.add(ax, {"type": "scatter", "mode": "markers", "x": xs, "y": ys,
                     "marker": {"symbol": "x", "size": 10, "color": BAD,
                                "line": {"width": 2, "color": BAD}},
                     "name": "non-finite", "text": texts, "meta": "nonfinite",
                     "hovertemplate": f"{html.escape(name)}: %{{text}}<extra></extra>"},
                "non-finite")
    if seg_x:
        fig.add(ax, {"type": "scatter", "mode": "lines", "x": seg_x, "y": seg_y,
                     "line": {"width": 3, "color": BAD}, "name": "non-finite",
                     "meta": "nonfinite_run", "hoverinfo": "skip"}, "non-finite")


def _positive(series: Sequence[Buckets]) -> bool:
    """Log axis: every finite value positive and spanning more than a decade (a narrower
    span on a log axis gets stray '2' / '5' minor tick labels and reads worse than linear)."""
    lo = [b.lo[np.isfinite(b.lo)] for b in series]
    hi = [b.hi[np.isfinite(b.hi)] for b in series]
    allv = np.concatenate(lo) if lo else np.zeros(0)
    top = np.concatenate(hi) if hi else np.zeros(0)
    if not len(allv) or not bool(np.all(allv > 0)):
        return False
    return float(top.max()) > 10 * float(allv.min())


def _heat(fig: _Fig, run: RunSeries) -> None:
    """Per-layer grad norm heat map: log10 of the largest finite value per cell; cells that
    held a non-finite value get the top color (red), labelled on the color bar."""
    h = run.grad_heat
    assert h is not None
    ax = fig.row(f"per-layer grad norm (log10) — {run.label}",
                 height=min(2.5, 0.8 + len(h.layers) / 40), category=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(np.where(h.hi > 0, h.hi, np.nan))
    finite = np.isfinite(z)
    zmin = float(z[finite].min()) if finite.any() else 0.0
    zmax = float(z[finite].max()) if finite.any() else 1.0
    if zmax <= zmin:
        zmax = zmin + 1.0
    sentinel = zmax + (zmax - zmin) * 0.15  # apart from the top tick: labels don't overlap
    z = np.where(h.nonfinite > 0, sentinel, z)
    top = (zmax - zmin) / (sentinel - zmin)
    scale = [[0, "#440154"], [top * 0.25, "#3b528b"], [top * 0.5, "#21918c"],
             [top * 0.75, "#5ec962"], [top, "#fde725"], [(top + 1) / 2, "#fde725"],
             [(top + 1) / 2, BAD], [1, BAD]]
    rows = [[None if not math.isfinite(v) else round(float(v), 2) for v in r] for r in z]
    # Explicit ticks: about one layer name per 14 px of the row, the long ones shortened from
    # the left (the full name is in the hover text).
    px = 190 * fig.rows[-1]["height"]
    every = max(1, math.ceil(len(h.layers) / max(1.0, px / 14)))
    shown = h.layers[::every]
    text = [n if len(n) <= LABEL_CHARS else "…" + n[-(LABEL_CHARS - 1):] for n in shown]
    fig.rows[-1]["axis"].update({"tickmode": "array", "tickvals": shown, "ticktext": text,
                                 "tickfont": {"size": 10}})
    fig.left = max(fig.left, min(300, 20 + 6 * max(map(len, text), default=0)))
    ticks = [round(zmin + (zmax - zmin) * k / 4, 2) for k in range(5)]
    colorbar = {"thickness": 10, "tickvals": [*ticks, sentinel],
                "ticktext": [*map(str, ticks), "non-finite"], "yanchor": "middle"}
    fig.rows[-1]["colorbars"].append(colorbar)
    fig.add(ax, {
        "type": "heatmap", "x": h.step.tolist(), "y": h.layers, "z": rows,
        "zmin": zmin, "zmax": sentinel, "colorscale": scale, "meta": "heat",
        "colorbar": colorbar,
        "hovertemplate": "%{y}<br>step %{x}<br>log10 grad norm %{z}<extra></extra>",
        "name": f"grad norm {run.label}",
    })


def build_figure(sources: Sequence[Source], runs: Sequence[RunSeries]) -> dict[str, Any]:
    """The Plotly figure (data + layout) of the runs' series."""
    fig = _Fig()
    color = {r.label: COLORS[i % len(COLORS)] for i, r in enumerate(runs)}
    shapes: list[dict[str, Any]] = []

    # Events: one row with alarms, actions and first non-finite values, hoverable.
    ev = fig.row("events (alarms, actions, first non-finite)", height=0.45, category=True,
                 fixed=True)
    firsts: list[tuple[int, str, str]] = []
    for src in sources:
        f = src.report.first_nonfinite
        if f and isinstance(f.get("step"), int):
            firsts.append((int(f["step"]), src.label, _finding_line(f)))
    for r in runs:
        alarms: dict[int, list[str]] = {}
        for a in r.alarms:
            alarms.setdefault(int(a["step"]), []).append(f"{a['kind']} {a['signal']}")
        acts: dict[int, list[str]] = {}
        for a in r.actions:
            acts.setdefault(int(a["step"]), []).append(f"{a['action']}: {a['detail']}")
        if alarms:
            fig.add(ev, {"type": "scatter", "mode": "markers", "x": list(alarms),
                         "y": ["alarm"] * len(alarms), "meta": "alarms",
                         "marker": {"symbol": "triangle-down", "size": 9, "color": "#e6a700"},
                         "text": ["<br>".join(sorted(set(v))[:6]) for v in alarms.values()],
                         "hovertemplate": f"{html.escape(r.label)} step %{{x}}<br>%{{text}}"
                                          "<extra></extra>", "name": "alarm"}, "alarms")
        if acts:
            fig.add(ev, {"type": "scatter", "mode": "markers", "x": list(acts),
                         "y": ["action"] * len(acts), "meta": "actions",
                         "marker": {"symbol": "diamond", "size": 9, "color": "#ff7f0e"},
                         "text": ["<br>".join(html.escape(s) for s in v[:4])
                                  for v in acts.values()],
                         "hovertemplate": f"{html.escape(r.label)} step %{{x}}<br>%{{text}}"
                                          "<extra></extra>", "name": "action"}, "actions")
        for kind, steps, style in (("alarm", sorted(alarms), ("#e6a700", "dot")),
                                   ("action", sorted(acts), ("#ff7f0e", "dash"))):
            for s in steps[:MAX_EVENT_LINES]:
                shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": s, "x1": s,
                               "y0": 0, "y1": 1, "layer": "below", "name": kind,
                               "line": {"color": style[0], "width": 1, "dash": style[1]}})
    if firsts:
        fig.add(ev, {"type": "scatter", "mode": "markers", "x": [f[0] for f in firsts],
                     "y": ["non-finite"] * len(firsts), "meta": "first_nonfinite",
                     "marker": {"symbol": "x", "size": 13, "color": BAD},
                     "text": [html.escape(f"{f[1]}: {f[2]}") for f in firsts],
                     "hovertemplate": "%{text}<extra></extra>", "name": "first non-finite"},
                "non-finite")
        for s, _, _ in firsts:
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": s, "x1": s,
                           "y0": 0, "y1": 1, "name": "first non-finite",
                           "line": {"color": BAD, "width": 2}})
    # Keep every category on the events axis, even when empty.
    fig.add(ev, {"type": "scatter", "mode": "markers", "x": [None] * 3,
                 "y": ["non-finite", "action", "alarm"], "showlegend": False,
                 "hoverinfo": "skip"})

    def rows_of(title: str, key: str, pick: Any, log: bool | None = None,
                bad_level: float | None = None) -> str | None:
        series = [(r, name, b) for r in runs for name, b in pick(r).items() if len(b)]
        if not series:
            return None
        ax = fig.row(title, log=_positive([b for _, _, b in series]) if log is None else log)
        for r, name, b in series:
            label = r.label if name == key else f"{r.label} {name}"
            _line(fig, ax, b, label, color[r.label], r.label, bad_level=bad_level,
                  dash=_DASHES[list(pick(r)).index(name) % len(_DASHES)])
        return ax

    def step_series(key: str) -> Any:
        return lambda r: {k: v for k, v in r.steps.items() if k == key}

    rows_of("loss", "loss", step_series("loss"))
    rows_of("global grad norm", "grad_norm",
            lambda r: {k: v for k, v in r.steps.items() if k == "grad_norm"})
    for r in [r for r in runs if r.grad_heat is not None][:MAX_HEATMAPS]:
        _heat(fig, r)
    limits = [r.act_limit for r in runs if r.act_limit is not None]
    limit = f" (dtype limit {min(limits):.3g})" if limits else ""
    rows_of(f"activation abs-max{limit}", "", lambda r: r.activations)
    head = rows_of("activation headroom: decades left to the dtype's limit, "
                   "log10(limit / abs-max)", "act_headroom", step_series("act_headroom"),
                   log=False, bad_level=0.0)
    if head is not None:
        shapes.append({"type": "line", "xref": "paper", "yref": f"y{head}", "x0": 0, "x1": 1,
                       "y0": 0, "y1": 0, "layer": "below", "name": "overflow",
                       "line": {"color": BAD, "width": 1, "dash": "dot"}})
    rows_of("optimizer-state norms", "", lambda r: r.state or step_series("momentum_norm")(r))
    rows_of("update / parameter ratio", "update_ratio", step_series("update_ratio"))
    rows_of("learning rate", "lr", step_series("lr"))
    rows_of("AMP loss scale (GradScaler)", "amp_scale", step_series("amp_scale"))
    layout = fig.layout(shapes)
    bottom = f"xaxis{len(fig.rows) if len(fig.rows) > 1 else ''}"
    layout[bottom]["title"] = {"text": "step"}
    return {"data": fig.data, "layout": layout}


_DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


# --------------------------------------------------------------------------- header


def _finding_line(first: dict[str, Any]) -> str:
    where = ", ".join(f"{k} {first[k]}" for k in ("phase", "module", "op")
                      if first.get(k) not in (None, ""))
    part = f" in {first['part']}" if first.get("part") else ""
    return f"first non-finite at step {first.get('step')}{part}" + (f" ({where})" if where
                                                                      else "")


def header_html(src: Source) -> str:
    """Status, first non-finite value and the ranked diagnosis of one run, as HTML."""
    rep = src.report
    e = html.escape
    color = _STATUS_COLOR.get(rep.status, BAD if rep.status not in OK_STATUSES else "#333")
    out = [f'<section class="run" data-status="{e(rep.status)}">',
           f'<h2><span class="status" style="background:{color}">{e(rep.status)}</span> '
           f'{e(src.label)} <small>{rep.steps} step{"" if rep.steps == 1 else "s"}, '
           f'{len(rep.alarms)} alarm{"" if len(rep.alarms) == 1 else "s"}, '
           f'{len(rep.actions)} action{"" if len(rep.actions) == 1 else "s"}'
           f'{" — " + e(str(rep.run.get("folder"))) if rep.run.get("folder") else ""}'
           '</small></h2>']
    first = rep.first_nonfinite
    if first:
        out.append(f'<p class="finding" data-step="{e(str(first.get("step")))}">'
                   f'<b>{e(_finding_line(first))}</b></p><table class="kv">')
        for k in ("step", "phase", "module", "op", "source", "samples", "signals", "ranks",
                  "param"):
            v = first.get(k)
            if v in (None, "", []):
                continue
            if isinstance(v, list):
                v = ", ".join(map(str, v[:16])) + (" ..." if len(v) > 16 else "")
            out.append(f"<tr><th>{e(k)}</th><td><code>{e(str(v))}</code></td></tr>")
        out.append("</table>")
    if rep.first_warning is not None and first:
        out.append(f"<p>first warning at step {rep.first_warning}: "
                   f"<b>{rep.lead_steps}</b> steps before the first non-finite value</p>")
    if rep.diagnosis:
        out.append('<ol class="diagnosis">')
        for cause in rep.diagnosis:
            conf = cause.get("confidence")
            conf_s = f" ({conf:.0%})" if isinstance(conf, (int, float)) else ""
            out.append(f'<li><b class="cause">{e(str(cause.get("cause")))}</b>{conf_s}'
                       f'<div class="why">why: {e(str(cause.get("evidence", "")))}</div>'
                       f'<div class="fix">fix: {e(str(cause.get("fix", "")))}</div></li>')
        out.append("</ol>")
    if rep.actions:
        shown = rep.actions[:6]
        out.append("<p>actions: " + "; ".join(
            e(f"step {a.get('step')}: {a.get('action')} — {a.get('detail')}") for a in shown)
            + (f" ... {len(rep.actions) - len(shown)} more" if len(rep.actions) > 6 else "")
            + "</p>")
    if not src.parts:
        out.append("<p><i>no run.db: nothing to plot</i></p>")
    out.append("</section>")
    return "\n".join(out)


# --------------------------------------------------------------------------- page

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:16px 24px;color:#222}
h1{font-size:20px;margin:0 0 8px} h2{font-size:17px;margin:8px 0}
h2 small{font-weight:normal;color:#666;font-size:13px}
.status{color:#fff;border-radius:4px;padding:2px 8px}
.run{border:1px solid #ddd;border-radius:6px;padding:6px 14px;margin:0 0 10px}
.finding{color:#b00;margin:6px 0} .kv th{text-align:left;padding-right:12px;color:#555}
.kv td code{white-space:pre-wrap} .diagnosis li{margin:4px 0} .why{color:#444}
.fix{color:#064;font-family:ui-monospace,monospace;white-space:pre-wrap}
#meta{color:#777;font-size:12px}
"""

_SCRIPT = """
var PAYLOAD = JSON.parse(document.getElementById('payload').textContent);
var LIVE = %(live)s;
function draw(p) {
  document.getElementById('header').innerHTML = p.header;
  document.getElementById('meta').textContent = p.meta;
  var div = document.getElementById('plots');
  if (p.figure.data.length) Plotly.react(div, p.figure.data, p.figure.layout,
      {responsive: true, displaylogo: false});
  window.NANGUARD_READY = true;
}
draw(PAYLOAD);
if (LIVE) {
  var poll = function() {
    fetch(LIVE, {cache: 'no-store'}).then(function(r) { return r.json(); })
      .then(function(p) { if (p.meta !== PAYLOAD.meta) { PAYLOAD = p; draw(p); } })
      .catch(function() {}).finally(function() { setTimeout(poll, 2000); });
  };
  setTimeout(poll, 2000);
}
"""


def payload(sources: Sequence[Source], *, line_buckets: int = LINE_BUCKETS,
            heat_buckets: int = HEAT_BUCKETS) -> dict[str, Any]:
    """Header HTML, figure and a summary line of the runs (what a page or the dashboard's
    API delivers)."""
    ranges = [step_range(folder) for s in sources for _, folder in s.parts]
    ranges = [r for r in ranges if r[1] >= r[0]]
    first = min((r[0] for r in ranges), default=0)
    last = max((r[1] for r in ranges), default=0)
    width = bucket_width(first, last, line_buckets)
    heat_width = bucket_width(first, last, heat_buckets)
    runs = []
    for s in sources:
        for label, folder in s.parts:
            runs.append(load_series(folder, label, origin=first, width=width,
                                    heat_width=heat_width))
    figure = build_figure(sources, runs)
    steps = sum(max(0, r.last_step - r.first_step + 1) for r in runs)
    meta = (f"{len(sources)} run{'s' if len(sources) != 1 else ''}, {steps} recorded steps"
            f"{f', {width} steps per point' if width > 1 else ''}; last step "
            f"{max((r.last_step for r in runs), default=-1)}; nanguard report")
    return {"header": "\n".join(header_html(s) for s in sources), "figure": figure,
            "meta": meta}


def _script_json(obj: Any) -> str:
    """JSON safe to embed in a <script> element (no `<` left to close it or open a comment;
    still valid JSON for `JSON.parse`)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render_page(title: str, data: dict[str, Any], *, live: str | None = None) -> str:
    """The whole HTML page: Plotly's JavaScript inlined, the data embedded; with `live` (a
    URL) it polls that URL for fresh data every 2 s (the dashboard)."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script>{plotly_js()}</script></head><body>"
        f"<h1>nanguard — {html.escape(title)}</h1><div id=\"meta\"></div>"
        "<div id=\"header\"></div><div id=\"plots\"></div>"
        f"<script type=\"application/json\" id=\"payload\">{_script_json(data)}</script>"
        f"<script>{_SCRIPT % {'live': _script_json(live)}}</script></body></html>\n"
    )


def write_html(runs: Sequence[str], out: str | os.PathLike[str], **kw: Any) -> Path:
    """Write the HTML report of one run (or several, overlaid) to `out`.

    Args:
        runs: run folders (a plain run, or a merged one whose report lists its parts).
        out: the HTML file to write.
        **kw: `line_buckets`, `heat_buckets` (see `payload`).

    Raises:
        ValueError: one line, for bad input (not a run folder, an unreadable run.db).
    """
    sources = load_sources(runs)
    title = ", ".join(s.label for s in sources)
    page = render_page(title, payload(sources, **kw))
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise ValueError(f"cannot write {str(path)!r} ({exc.strerror or exc})") from None
    return path
