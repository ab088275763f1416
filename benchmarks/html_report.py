"""Size and render time of the HTML report of a long run (budget: 1e6 steps x 300 layers,
<= 10 MB, interactive in <= 2 s in headless Chromium).

Builds a synthetic run.db: every step in `steps` (loss, grad norm, update ratio every 10,
LR, AMP loss scale, activation abs-max with the float16 limit), per-layer `param_stats` (grad
norm, param norm, Adam state) every `--param-every` steps,
12 modules' activation abs-max, a NaN from 90% of the run on, a few alarms. Then writes the
report with `nanguard.show.html.write_html` and loads it in headless Debian Chromium through
Playwright: time from navigation to the page drawn (`NANGUARD_READY`) and to the end of a zoom
(a relayout of the shared x axis).

With `--compare-libs` it also renders the same content (8 line plots of 2000 points, one
300 x 800 heat map, linked x) with Plotly and with Bokeh, each library's JavaScript inlined,
and prints both pages' size and render time.

    python benchmarks/html_report.py --steps 1000000 --layers 300 --param-every 100
    python benchmarks/html_report.py --compare-libs
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import tempfile
import time
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--no-first-run"]


def make_run(folder: Path, steps: int, layers: int, param_every: int) -> float:
    """Write the synthetic run; returns the seconds it took."""
    from nanguard.record.report import Report
    from nanguard.record.store import SCHEMA, STEP_ROW

    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(folder / "run.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")
    db.executescript(SCHEMA)
    bad = int(steps * 0.9)
    rng = random.Random(0)

    def val(s: int, base: float) -> float | str:
        return "nan" if s >= bad else base * (1 + 0.2 * rng.random()) * (1 + s / steps)

    db.executemany("INSERT INTO params VALUES (?,?,?,?)",
                   [(i, f"layers.{i}.weight", "[256, 256]", 65536) for i in range(layers)])
    chunk = 100_000
    for a in range(0, steps, chunk):
        db.executemany(f"INSERT INTO steps ({', '.join(STEP_ROW)}) "
                       f"VALUES ({', '.join('?' * len(STEP_ROW))})", [
            (s, 0.0, val(s, 2.0 * math.exp(-s / steps)), val(s, 1.0), val(s, 50.0),
             val(s, 1e-3) if s % 10 == 0 else None, val(s, 0.5), val(s, 10.0),
             3e-4 * min(1.0, s / 2000 + 1e-3), "[]" if s < bad else '["loss"]', 0,
             2.0 ** (16 - (s * 7) // steps), 65504.0)
            for s in range(a, min(steps, a + chunk))])
    state = json.dumps({"exp_avg": 0.01, "exp_avg_sq": 1e-5})
    state_bad = json.dumps({"exp_avg": "nan", "exp_avg_sq": "nan"})
    rows: list[tuple[int, int, float | str, float, str]] = []
    for s in range(0, steps, param_every):
        for i in range(layers):
            g = "nan" if s >= bad else (i + 1) * 0.01 * (1 + 0.3 * rng.random())
            rows.append((s, i, g, 1.0, state_bad if s >= bad else state))
        if len(rows) >= 200_000:
            db.executemany("INSERT INTO param_stats VALUES (?,?,?,?,?)", rows)
            rows.clear()
    db.executemany("INSERT INTO param_stats VALUES (?,?,?,?,?)", rows)
    db.executemany("INSERT INTO activations VALUES (?,?,?)", [
        (s, f"block{m}", val(s, 5.0 * (m + 1))) for s in range(0, steps, param_every)
        for m in range(12)])
    db.executemany("INSERT INTO alarms VALUES (?,?,?,?,?)", [
        (bad - 3, "spike", "grad", 10.0, "grad norm spike"), (bad, "nonfinite", "loss", "nan",
                                                              "non-finite value in loss")])
    db.commit()
    db.close()
    Report(status="failed", steps=steps, first_nonfinite={
        "step": bad, "phase": "forward", "module": "block3", "op": "aten.exp", "source":
        "model.py:42", "samples": [3]}, diagnosis=[{
            "cause": "exp_overflow", "confidence": 0.9, "evidence": "synthetic",
            "fix": "use logsumexp"}], run={"folder": str(folder)}).write(folder)
    return time.perf_counter() - t0


def render(path: Path, ready: str, runs: int = 3) -> dict[str, float]:
    """Median seconds to the page drawn and to a zoom done, in headless Chromium."""
    from playwright.sync_api import sync_playwright

    drawn, zoomed = [], []
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for _ in range(runs):
            ctx = b.new_context(viewport={"width": 1300, "height": 900})
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
            t0 = time.perf_counter()
            page.goto(path.as_uri(), timeout=120_000)
            page.wait_for_function(ready, timeout=120_000, polling=20)
            drawn.append(time.perf_counter() - t0)
            if "NANGUARD" in ready:
                page.evaluate("() => Plotly.relayout('plots', {'xaxis.range': [100, 5000]})")
            zoomed.append(time.perf_counter() - t0)
            if errors:
                raise RuntimeError(f"page errors: {errors[:3]}")
            ctx.close()
        b.close()
    drawn.sort()
    zoomed.sort()
    return {"drawn_s": drawn[len(drawn) // 2], "zoomed_s": zoomed[len(zoomed) // 2]}


def compare_libs(out: Path) -> None:
    """The same content with Plotly and with Bokeh: size and render time."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.arange(0, 1_000_000, 500)
    lines = [np.exp(rng.normal(size=len(x))) for _ in range(8)]
    heat = rng.normal(size=(300, 800))
    hx = np.arange(0, 1_000_000, 1250)

    # Plotly, the way nanguard.show.html builds it (figure JSON + inlined plotly.js).
    from plotly.offline import get_plotlyjs

    data, layout = [], {"height": 2200, "showlegend": False}
    n = 9
    for i in range(n):
        s = "" if i == 0 else str(i + 1)
        layout[f"yaxis{s}"] = {"domain": [1 - (i + 1) / n + 0.01, 1 - i / n - 0.01]}
        layout[f"xaxis{s}"] = {"anchor": f"y{s}", **({"matches": "x"} if i else {})}
        if i < 8:
            data.append({"type": "scatter", "mode": "lines", "x": x.tolist(),
                         "y": np.round(lines[i], 4).tolist(), "xaxis": f"x{s}",
                         "yaxis": f"y{s}"})
        else:
            data.append({"type": "heatmap", "x": hx.tolist(), "z": np.round(heat, 2).tolist(),
                         "xaxis": f"x{s}", "yaxis": f"y{s}"})
    plotly_page = out / "plotly.html"
    plotly_page.write_text(
        f"<html><head><script>{get_plotlyjs()}</script></head><body><div id='plots'></div>"
        f"<script>Plotly.newPlot('plots', {json.dumps(data)}, {json.dumps(layout)})"
        ".then(() => {window.NANGUARD_READY = true;});</script></body></html>")

    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.plotting import figure
    from bokeh.resources import INLINE

    figs = []
    for i in range(8):
        shared = {"x_range": figs[0].x_range} if figs else {}
        f = figure(height=220, width=1200, y_axis_type="log", **shared)
        f.line(x, lines[i])
        figs.append(f)
    f = figure(height=400, width=1200, x_range=figs[0].x_range)
    f.image(image=[heat], x=0, y=0, dw=1_000_000, dh=300, palette="Viridis256")
    figs.append(f)
    bokeh_page = out / "bokeh.html"
    page = file_html(column(*figs), INLINE, "bokeh")
    # Ready when Bokeh has built the views of every plot.
    page = page.replace("</body>", "<script>var iv = setInterval(function() {"
                        "if (window.Bokeh && Bokeh.index && Object.keys(Bokeh.index).length ||"
                        " (Bokeh.index && Bokeh.index.roots && Bokeh.index.roots.length)) {"
                        "requestAnimationFrame(function(){window.BK_READY = true;});"
                        "clearInterval(iv);}}, 10);</script></body>")
    bokeh_page.write_text(page)
    for name, path, ready in (("plotly", plotly_page, "window.NANGUARD_READY === true"),
                              ("bokeh", bokeh_page, "window.BK_READY === true")):
        r = render(path, ready)
        print(f"{name}: {path.stat().st_size / 1e6:.2f} MB, drawn in {r['drawn_s']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--param-every", type=int, default=100,
                    help="per-layer rows every N steps (1: every step, the full 3e8 rows)")
    ap.add_argument("--out", default="", help="work folder (default: a temporary one)")
    ap.add_argument("--compare-libs", action="store_true")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="nanguard_html_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    if args.compare_libs:
        compare_libs(out)
        return
    from nanguard.show.html import write_html

    run = out / "run"
    gen = make_run(run, args.steps, args.layers, args.param_every)
    n_param = math.ceil(args.steps / args.param_every) * args.layers
    print(f"run: {args.steps} steps, {args.layers} layers, {n_param} param_stats rows "
          f"(every {args.param_every} steps), generated in {gen:.1f} s")
    t0 = time.perf_counter()
    page = write_html([str(run)], out / "report.html")
    build = time.perf_counter() - t0
    size = page.stat().st_size
    print(f"build: {build:.1f} s; HTML {size / 1e6:.2f} MB")
    r = render(page, "window.NANGUARD_READY === true")
    print(f"chromium: drawn in {r['drawn_s']:.2f} s, zoomed in {r['zoomed_s']:.2f} s "
          f"(median of 3)")
    print(f"budget: size <= 10 MB {'OK' if size <= 10e6 else 'OVER'}; interactive <= 2 s "
          f"{'OK' if r['zoomed_s'] <= 2 else 'OVER'}")


if __name__ == "__main__":
    main()
