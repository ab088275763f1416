"""The linked plots of the HTML report, built with Bokeh (its JavaScript is inlined by
`nanguard.show.html`).

One figure per row, every figure on the same x range (zoom or pan one, all follow): events
(alarms, actions, first non-finite value), loss, global grad norm, per-layer grad norm heat map,
activation abs-max and headroom, optimizer-state norms, update ratio, LR, AMP loss scale.
Alarm and action steps and the first non-finite step are vertical lines on every figure;
non-finite values are red crosses, never dropped. Several runs, or the parts of a merged run,
give one line each.

Names the page and the browser tests find the models by: the shared x range is `x`; every
figure is `row:<series>` (`row:events`, `row:loss`, `row:heat:<run>`, ...); its lines are one
renderer `series` (their labels in its source's `name` column); renderers of
non-finite markers carry the tag `nonfinite` (segments over a run of them `nonfinite_run`),
the heat map's image `heat`; the vertical lines' source is `lines` (its `kind` column:
`alarm`, `action`, `first_nonfinite`); loss spike episodes are shaded on the loss figure by a
renderer tagged `spike_episode`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nanguard.show.markers import BAD, SPIKE, bad_markers, positive
from nanguard.show.series import Buckets, RunSeries

COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
          "#7f7f7f")
DASHES = ("solid", "dashed", "dotted", "dotdash", "dashdot")
MAX_HEATMAPS = 4
"""Heat maps drawn at most (one per run or part)."""
MAX_EVENT_LINES = 300
"""Vertical alarm / action lines drawn at most per run (the earliest ones)."""
LABEL_CHARS = 40
"""Layer names on the heat map's axis are shortened to this many characters."""
LINE_STYLES = {"alarm": ("#e6a700", "dotted", 1), "action": ("#ff7f0e", "dashed", 1),
               "first_nonfinite": (BAD, "solid", 2)}
"""Color, dash and width of the vertical lines at alarm, action and first non-finite steps."""
ROW_PX = 190
"""Height of a line plot in pixels."""
RIGHT_PX = 110
"""Right border of every figure: room for the heat map's color bar, the same for all so
that the x axes line up."""


def _bokeh() -> Any:
    try:
        import bokeh.models as models
        import bokeh.plotting as plotting
    except ImportError:
        raise ValueError("the HTML report needs bokeh: pip install 'nanguard[html]'") from None
    return models, plotting


class Rows:
    """The figures of one page, created on the shared x range."""

    def __init__(self, x0: float, x1: float) -> None:
        self.models, self.plotting = _bokeh()
        self.x = self.models.Range1d(x0, x1, name="x")
        self.figs: list[Any] = []
        self.left = 70
        """Left border in pixels, the same for every figure (widened for layer names)."""

    def add(self, key: str, title: str, *, height: float = 1.0, log: bool = False,
            from_zero: bool = False, **kw: Any) -> Any:
        """A new figure on the shared x range (`kw`: more figure properties)."""
        if not log and from_zero:
            kw.setdefault("y_range", self.models.DataRange1d(start=0))
        fig = self.plotting.figure(
            name=f"row:{key}", title=title, x_range=self.x, height=int(ROW_PX * height),
            y_axis_type="log" if log else "auto", sizing_mode="stretch_width",
            tools="xpan,xwheel_zoom,xbox_zoom,reset,save", active_drag="xbox_zoom",
            background_fill_color="#fafafa", min_border_right=RIGHT_PX,
            toolbar_location=None, output_backend="canvas", **kw)
        fig.title.text_font_size = "12px"
        # No minor ticks: less for the browser to draw, nothing lost at this size.
        fig.xaxis.minor_tick_line_color = None
        fig.yaxis.minor_tick_line_color = None
        fig.xaxis.axis_label_text_font_size = "11px"
        fig.yaxis.major_label_text_font_size = "10px"
        fig.xaxis.major_label_text_font_size = "10px"
        self.figs.append(fig)
        return fig

    def legend(self, fig: Any) -> None:
        if fig.legend:
            fig.legend.location = "top_left"
            fig.legend.label_text_font_size = "10px"
            fig.legend.background_fill_alpha = 0.6
            fig.legend.spacing = 0
            fig.legend.padding = 4
            fig.legend.orientation = "horizontal"

    def layout(self, lines: Any) -> Any:
        """Every figure with the vertical event lines and a shared toolbar, in one column."""
        for fig in self.figs:
            fig.min_border_left = self.left
            if len(lines.data["x"]):
                # One renderer for all the lines of a figure: each renderer costs Bokeh style
                # and layout reads when the page is built.
                fig.vspan(x="x", source=lines, line_color="color", line_dash="dash",
                          line_width="width", level="underlay")
        self.figs[-1].xaxis.axis_label = "step"
        return self.plotting.gridplot([[f] for f in self.figs], merge_tools=True,
                                      toolbar_location="right", sizing_mode="stretch_width")


def _source(**cols: Any) -> Any:
    models, _ = _bokeh()
    return models.ColumnDataSource(data=cols)


class Lines:
    """The series of one figure, drawn with four renderers whatever their number: one
    multi-line for the last values, one set of patches for the min..max bands, one scatter
    for the non-finite markers and one multi-line for the segments over runs of them (each
    renderer costs Bokeh style and layout work when the page is built)."""

    def __init__(self) -> None:
        self.line: dict[str, list[Any]] = {k: [] for k in ("xs", "ys", "name", "color",
                                                            "dash")}
        self.band: dict[str, list[Any]] = {k: [] for k in ("xs", "ys", "color")}
        self.mark: dict[str, list[Any]] = {k: [] for k in ("x", "y", "text")}
        self.seg: dict[str, list[Any]] = {"xs": [], "ys": []}

    def add(self, b: Buckets, name: str, color: str, dash: str = "solid",
            bad_level: float | None = None) -> None:
        """A bucketed series: its min..max band (when downsampled), last value and non-finite
        markers (`bad_level`: the height of the markers, e.g. 0 decades of headroom)."""
        x = b.step.astype(np.float64)
        # +-Inf becomes a gap like NaN (it is drawn as a marker): an infinite value would
        # stretch the figure's automatic y range to infinity and hide every finite point.
        last = np.where(np.isfinite(b.last), b.last, np.nan)
        for key, v in zip(self.line, (x, last, name, color, dash), strict=True):
            self.line[key].append(v)
        if len(b) and bool(np.any(np.nan_to_num(b.hi - b.lo) > 0)):
            # One polygon per stretch of buckets with finite values (NaN splits it).
            ok = np.isfinite(b.lo) & np.isfinite(b.hi)
            cuts = np.flatnonzero(np.diff(np.r_[0, ok.astype(np.int8), 0]))
            for i, j in zip(cuts[::2], cuts[1::2], strict=True):
                self.band["xs"].append(np.r_[x[i:j], x[i:j][::-1]])
                self.band["ys"].append(np.r_[b.hi[i:j], b.lo[i:j][::-1]])
                self.band["color"].append(color)
        xs, ys, texts, seg_x, seg_y = bad_markers(b)
        if bad_level is not None:
            ys = [bad_level] * len(ys)
            seg_y = [None if y is None else bad_level for y in seg_y]
        self.mark["x"] += xs
        self.mark["y"] += ys
        self.mark["text"] += [f"{name}: {t}" for t in texts]
        for k in range(0, len(seg_x), 3):
            self.seg["xs"].append(seg_x[k:k + 2])
            self.seg["ys"].append(seg_y[k:k + 2])

    def draw(self, rows: Rows, fig: Any) -> None:
        hover = rows.models.HoverTool
        if self.band["xs"]:
            fig.patches(xs="xs", ys="ys", source=_source(**self.band), fill_color="color",
                        fill_alpha=0.25, line_width=0)
        r = fig.multi_line(xs="xs", ys="ys", source=_source(**self.line), line_color="color",
                           line_dash="dash", line_width=1.5, legend_field="name", name="series")
        fig.add_tools(hover(renderers=[r], line_policy="nearest",
                            formatters={"$snap_y": "printf"}, tooltips=[
                                ("", "@name"), ("step", "$snap_x{0}"),
                                ("value", "$snap_y{%0.4g}")]))
        if self.mark["x"]:
            m = fig.scatter(x="x", y="y", source=_source(**self.mark), marker="x", size=11,
                            line_width=2.5, color=BAD)
            m.tags = ["nonfinite"]  # on the renderer (a `tags=` argument would go to the glyph)
            fig.add_tools(hover(renderers=[m], tooltips=[("non-finite", "@text")]))
        if self.seg["xs"]:
            seg = fig.multi_line(xs="xs", ys="ys", source=_source(**self.seg), line_color=BAD,
                                 line_width=3)
            seg.tags = ["nonfinite_run"]


def heat(rows: Rows, run: RunSeries, origin: int, width: int) -> None:
    """Per-layer grad norm heat map: log10 of the largest finite value per cell; cells that
    held a non-finite value red (the color map's high color)."""
    h = run.grad_heat
    assert h is not None
    n = len(h.layers)
    cols = ((h.step - origin) // max(1, width)).astype(np.int64)
    ncols = int(cols.max()) + 1 if len(cols) else 1
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.log10(np.where(h.hi > 0, h.hi, np.nan))
    finite = np.isfinite(z)
    zmin = float(z[finite].min()) if finite.any() else 0.0
    zmax = float(z[finite].max()) if finite.any() else 1.0
    zmax = zmax if zmax > zmin else zmin + 1.0
    z = np.where(h.nonfinite > 0, zmax + 1.0, z)  # above the map's top: drawn in high_color
    grid = np.full((n, ncols), np.nan, dtype=np.float32)
    grid[:, cols] = z
    height = min(2.5, 0.8 + n / 40)
    fig = rows.add(f"heat:{run.label}",
                   f"per-layer grad norm (log10, red: non-finite) — {run.label}",
                   height=height, y_range=rows.models.Range1d(0, n))
    models = rows.models
    mapper = models.LinearColorMapper(palette="Viridis256", low=zmin, high=zmax,
                                      high_color=BAD, nan_color="rgba(0,0,0,0)")
    img = fig.image(image=[grid], x=origin, y=0, dw=ncols * max(1, width), dh=n,
                    color_mapper=mapper)
    img.tags = ["heat"]
    # One layer name per label row; long ones shortened from the left (full in the hover).
    every = max(1, math.ceil(n / max(1.0, ROW_PX * height / 14)))
    short = [s if len(s) <= LABEL_CHARS else "…" + s[-(LABEL_CHARS - 1):] for s in h.layers]
    fig.yaxis.ticker = models.FixedTicker(ticks=[i + 0.5 for i in range(0, n, every)])
    fig.yaxis.formatter = models.CustomJSTickFormatter(
        args={"names": short}, code="const s = names[Math.floor(tick)]; return s ?? ''")
    fig.ygrid.visible = False
    rows.left = max(rows.left, min(300, 20 + 6 * max(map(len, short[::every]), default=0)))
    name = models.CustomJSHover(args={"names": h.layers},
                                code="return names[Math.floor(value)] ?? ''")
    fig.add_tools(models.HoverTool(renderers=[img], formatters={"$y": name}, tooltips=[
        ("layer", "$y{custom}"), ("step", "$x{0}"), ("log10 grad norm", "@image{0.00}")]))
    fig.add_layout(models.ColorBar(color_mapper=mapper, width=8, padding=4,
                                   major_label_text_font_size="9px"), "right")


def events(rows: Rows, runs: Sequence[RunSeries],
           firsts: Sequence[tuple[int, str, str]]) -> Any:
    """The events row (alarms, actions, first non-finite values, hoverable) and the source of
    the vertical lines drawn across every figure (columns x, kind, color, dash, width)."""
    fig = rows.add("events", "events (alarms, actions, first non-finite)", height=0.5,
                   y_range=rows.models.FactorRange("non-finite", "action", "alarm"))
    fig.ygrid.visible = False
    lines: dict[str, list[int]] = {"alarm": [], "action": [], "first_nonfinite": []}
    hover = []
    marks = []
    for r in runs:
        alarms: dict[int, list[str]] = {}
        for a in r.alarms:
            alarms.setdefault(int(a["step"]), []).append(f"{a['kind']} {a['signal']}")
        acts: dict[int, list[str]] = {}
        for a in r.actions:
            acts.setdefault(int(a["step"]), []).append(f"{a['action']}: {a['detail']}")
        for kind, found, marker, color, n in (("alarm", alarms, "inverted_triangle", "#e6a700",
                                               6),
                                              ("action", acts, "diamond", "#ff7f0e", 4)):
            if found:
                marks.append((kind, marker, color, list(found),
                              [f"{r.label}: " + "; ".join(sorted(set(v))[:n])
                               for v in found.values()]))
                lines[kind] += sorted(found)[:MAX_EVENT_LINES]
    if firsts:
        marks.append(("non-finite", "x", BAD, [f[0] for f in firsts],
                      [f"{f[1]}: {f[2]}" for f in firsts]))
        lines["first_nonfinite"] = [f[0] for f in firsts]
    for kind, marker, color, xs, texts in marks:
        r = fig.scatter(x="x", y="y", source=_source(x=xs, y=[kind] * len(xs), text=texts),
                        marker=marker, size=13 if kind == "non-finite" else 10, color=color,
                        line_width=2.5 if kind == "non-finite" else 1, name=kind)
        r.tags = [kind.replace("-", "")]
        hover.append(r)
    if hover:
        fig.add_tools(rows.models.HoverTool(renderers=hover, tooltips=[
            ("$name", "step @x{0}"), ("", "@text")]))
    cols: dict[str, list[Any]] = {"x": [], "kind": [], "color": [], "dash": [], "width": []}
    for kind, steps in lines.items():
        color, dash, width = LINE_STYLES[kind]
        for s in sorted(set(steps)):
            for key, v in zip(cols, (s, kind, color, dash, width), strict=True):
                cols[key].append(v)
    return rows.models.ColumnDataSource(data=cols, name="lines")


def spike_spans(rows: Rows, fig: Any, spans: tuple[list[float], list[float], list[str]]
                ) -> None:
    """Shade loss spike episodes on `fig` (`markers.episode_spans`), under the lines, with
    their story in the hover. The renderer carries the tag `spike_episode`."""
    x0, x1, texts = spans
    if not x0:
        return
    src = _source(x0=x0, x1=x1, text=texts)
    r = fig.vstrip(x0="x0", x1="x1", source=src, fill_color=SPIKE, fill_alpha=0.35,
                   line_width=0, level="underlay")
    r.tags = ["spike_episode"]
    fig.add_tools(rows.models.HoverTool(renderers=[r], tooltips=[("", "@text")]))


def series_row(rows: Rows, key: str, title: str, series: list[tuple[RunSeries, str, Buckets]],
               color: dict[str, str], order: dict[str, list[str]], *,
               log: bool | None = None, bad_level: float | None = None) -> Any:
    """A figure of line series (one per run and name), or None when there is nothing."""
    if not series:
        return None
    if log is None:
        log = positive([b for _, _, b in series])
    from_zero = all(float(np.nanmin(b.lo, initial=0)) >= 0 for _, _, b in series
                    if np.isfinite(b.lo).any())
    fig = rows.add(key, title, log=log, from_zero=from_zero)
    lines = Lines()
    for r, name, b in series:
        label = r.label if name == key else f"{r.label} {name}"
        dash = DASHES[order[r.label].index(name) % len(DASHES)]
        lines.add(b, label, color[r.label], dash, bad_level=bad_level)
    lines.draw(rows, fig)
    rows.legend(fig)
    return fig
