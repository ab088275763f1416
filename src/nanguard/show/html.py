"""The HTML report: one self-contained page (Bokeh's JavaScript inlined, nothing fetched).

On top the finding: status, the first non-finite value and the ranked diagnosis with its fix.
Below, linked plots over steps sharing one x range (zoom one, all follow; see
`nanguard.show.plots`). Several runs (`nanguard report A B --html F`) or the parts of a merged
run (several optimizers or ranks) give one line each.

Long runs are downsampled per bucket of steps (`nanguard.show.series`): the page stays small
and a non-finite step is never averaged away.

The page needs the optional `html` extra (`pip install nanguard[html]`): Bokeh, whose
JavaScript ships inside its PyPI package and is copied into every page. Bokeh rather than
Plotly because evaluating plotly.js alone in Chromium takes most of the 2 s budget of a long
run's page, several times what bokeh.min.js takes (BENCHMARKS.md, "HTML report").
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanguard.record.report import OK_STATUSES, REPORT_NAME, Report, load_report
from nanguard.record.spike_run import measure_run
from nanguard.record.store import DB_NAME
from nanguard.show import plots
from nanguard.show.markers import episode_spans
from nanguard.show.series import RunSeries, bucket_width, load_series, step_range
from nanguard.show.summary import first_where, heal_line, report_spike_line

LINE_BUCKETS = 1000
"""At most this many buckets per line series."""
HEAT_BUCKETS = 400
"""At most this many buckets (columns) in a per-layer heat map."""

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


def bokeh_js() -> str:
    """BokehJS's core bundle, from the bokeh package (nothing is fetched; the widget, table,
    GL and MathJax bundles are not needed by the plots)."""
    try:
        from bokeh.resources import Resources
    except ImportError:
        raise ValueError("the HTML report needs bokeh: pip install 'nanguard[html]'") from None
    core = Resources(mode="inline", components=["bokeh"]).js_raw[0]
    return core + '\nBokeh.set_log_level("warn");'  # not an info line per document drawn


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
                  first_nonfinite=first, run={"folder": str(path), "closed": False},
                  spike_measures=measure_run(path))


def run_parts(folder: str, report: Report, label: str) -> list[tuple[str, str]]:
    """The stores to plot for a run: its own run.db, or each part of a merged run
    (`run.parts`, see `nanguard.record.merge`) that has one."""
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


# --------------------------------------------------------------------------- plots


def build_layout(sources: Sequence[Source], runs: Sequence[RunSeries], *, origin: int = 0,
                 heat_width: int = 1) -> Any:
    """The Bokeh layout of the runs' series: linked figures in one column, or None when no
    run has a recorded step."""
    if not any(r.last_step >= r.first_step for r in runs):
        return None
    x0 = min(r.first_step for r in runs if r.last_step >= r.first_step)
    x1 = max(r.last_step for r in runs)
    pad = max(1.0, (x1 - x0) * 0.01)
    rows = plots.Rows(x0 - pad, x1 + pad)
    color = {r.label: plots.COLORS[i % len(plots.COLORS)] for i, r in enumerate(runs)}
    firsts = [(int(f["step"]), s.label, _finding_line(f)) for s in sources
              for f in [s.report.first_nonfinite] if f and isinstance(f.get("step"), int)]
    lines = plots.events(rows, runs, firsts)

    def row(key: str, title: str, pick: Any, **kw: Any) -> Any:
        order = {r.label: list(pick(r)) for r in runs}
        series = [(r, name, b) for r in runs for name, b in pick(r).items() if len(b)]
        return plots.series_row(rows, key, title, series, color, order, **kw)

    def step_series(key: str) -> Any:
        return lambda r: {k: v for k, v in r.steps.items() if k == key}

    loss = row("loss", "loss", step_series("loss"))
    if loss is not None:
        for s in sources:  # every run's spike episodes, healthy runs too
            plots.spike_spans(rows, loss, episode_spans(s.report.spike_measures, x1))
    row("grad_norm", "global grad norm", step_series("grad_norm"))
    for r in [r for r in runs if r.grad_heat is not None][:plots.MAX_HEATMAPS]:
        plots.heat(rows, r, origin, heat_width)
    limits = [r.act_limit for r in runs if r.act_limit is not None]
    limit = f" (dtype limit {min(limits):.3g})" if limits else ""
    row("activations", f"activation abs-max{limit}", lambda r: r.activations)
    row("attn_logit_max", "largest |attention logit| (softmax input, masked entries excluded)",
        step_series("attn_logit_max"))
    head = row("act_headroom", "activation headroom: decades left to the dtype's limit, "
               "log10(limit / abs-max)", step_series("act_headroom"), log=False, bad_level=0.0)
    if head is not None:
        head.add_layout(rows.models.Span(location=0, dimension="width", line_color=plots.BAD,
                                         line_dash="dotted", line_width=1))
    row("state", "optimizer-state norms", lambda r: r.state or step_series("momentum_norm")(r))
    row("update_ratio", "update / parameter ratio", step_series("update_ratio"))
    row("lr", "learning rate", step_series("lr"))
    row("amp_scale", "AMP loss scale (GradScaler)", step_series("amp_scale"))
    return rows.layout(lines)


# --------------------------------------------------------------------------- header


def _finding_line(first: dict[str, Any]) -> str:
    where = first_where(first)
    part = f" in {first['part']}" if first.get("part") else ""
    return f"first non-finite at step {first.get('step')}{part}" + (f" ({where})" if where
                                                                      else "")


def header_html(src: Source) -> str:
    """Status, first non-finite value and the ranked diagnosis of one run, as HTML."""
    rep = src.report
    e = html.escape
    color = _STATUS_COLOR.get(rep.status, plots.BAD if rep.status not in OK_STATUSES else "#333")
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
    spikes = report_spike_line(rep)
    if spikes:
        out.append(f'<p class="spikes">{e(spikes)}</p>')
    heal = heal_line(rep)  # what heal did, what it cost and why; or the remedy to try
    if heal:
        out.append(f'<p class="heal">{e(heal)}</p>')
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
var SHOWN = null;
function ready() { window.NANGUARD_READY = true; }
function draw(p) {
  document.getElementById('header').innerHTML = p.header;
  document.getElementById('meta').textContent = p.meta;
  var keep = null;
  if (SHOWN) {
    // A live update keeps the user's zoom (a range other than the one drawn last time).
    var old = SHOWN.doc.get_model_by_name('x');
    if (old.start !== SHOWN.x[0] || old.end !== SHOWN.x[1]) keep = [old.start, old.end];
    SHOWN.views.roots.forEach(function(v) { v.remove(); });
    var i = Bokeh.documents.indexOf(SHOWN.doc);
    if (i >= 0) Bokeh.documents.splice(i, 1);
    SHOWN = null;
  }
  document.getElementById('plots').innerHTML = '';
  if (!p.plot) { ready(); return Promise.resolve(); }
  return Bokeh.embed.embed_item(p.plot, 'plots').then(function(views) {
    var doc = views.roots[0].model.document;
    var x = doc.get_model_by_name('x');
    SHOWN = {views: views, doc: doc, x: [x.start, x.end]};
    if (keep) x.setv({start: keep[0], end: keep[1]});
    // Ready once every figure has painted (Bokeh's document idle signal).
    if (doc.is_idle) ready(); else doc.idle.connect(ready);
  });
}
draw(PAYLOAD);
if (LIVE) {
  var poll = function() {
    fetch(LIVE, {cache: 'no-store'}).then(function(r) { return r.json(); })
      .then(function(p) { if (p.meta !== PAYLOAD.meta) { PAYLOAD = p; return draw(p); } })
      .catch(function(e) { console.warn('nanguard: live update failed', e); })
      .finally(function() { setTimeout(poll, 2000); });
  };
  setTimeout(poll, 2000);
}
"""


def payload(sources: Sequence[Source], *, line_buckets: int = LINE_BUCKETS,
            heat_buckets: int = HEAT_BUCKETS) -> dict[str, Any]:
    """Header HTML, the plots (a Bokeh JSON item, None without data) and a summary line of
    the runs (what a page or the dashboard's API delivers)."""
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
    layout = build_layout(sources, runs, origin=first, heat_width=heat_width)
    steps = sum(max(0, r.last_step - r.first_step + 1) for r in runs)
    meta = (f"{len(sources)} run{'s' if len(sources) != 1 else ''}, {steps} recorded steps"
            f"{f', {width} steps per point' if width > 1 else ''}; last step "
            f"{max((r.last_step for r in runs), default=-1)}; nanguard report")
    plot = None
    if layout is not None:
        from bokeh.core.validation import silence
        from bokeh.core.validation.warnings import MISSING_RENDERERS
        from bokeh.embed import json_item
        from bokeh.settings import settings

        silence(MISSING_RENDERERS)  # the events figure of a run without events: fine
        # Arrays uncompressed: inflating them costs the browser more than the bigger file.
        settings.compression_level.set_value(0)
        try:
            plot = json_item(layout)
        finally:
            settings.compression_level.unset_value()
    return {"header": "\n".join(header_html(s) for s in sources), "plot": plot, "meta": meta}


def _script_json(obj: Any) -> str:
    """JSON safe to embed in a <script> element (no `<` left to close it or open a comment;
    still valid JSON for `JSON.parse`)."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")


def render_page(title: str, data: dict[str, Any], *, live: str | None = None) -> str:
    """The whole HTML page: Bokeh's JavaScript inlined, the data embedded; with `live` (a
    URL) it polls that URL for fresh data every 2 s (the dashboard)."""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style>"
        f"<script>{bokeh_js()}</script></head><body>"
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
