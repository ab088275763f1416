"""Size and render time of the HTML report of a long run (budget: 1e6 steps x 300 layers,
<= 10 MB, interactive in <= 2 s in headless Chromium).

Builds a synthetic run.db: every step in `steps` (loss, grad norm, update ratio every 10,
LR, AMP loss scale, activation abs-max with the float16 limit), per-layer `param_stats` (grad
norm, param norm, Adam state) every `--param-every` steps,
12 modules' activation abs-max, a NaN from 90% of the run on, a few alarms. Then writes the
report with `nanguard.show.html.write_html` and loads it in headless Debian Chromium through
Playwright: time from navigation to the page drawn (`NANGUARD_READY`) and to the end of a zoom
(a relayout of the shared x axis).

In the same rounds it loads pages that only evaluate the plotting library's JavaScript
(bokeh.min.js, and plotly.min.js when plotly is installed) and a blank page: the floor under
the report's time at the machine's current load. `--pages` adds more HTML files (e.g. the
Plotly report of an earlier commit) to the same rounds.

    python benchmarks/html_report.py --steps 1000000 --layers 300 --param-every 100
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
             2.0 ** (16 - (s * 7) // steps), 65504.0, val(s, 1e-5), val(s, 8.0), None)
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


ZOOM = """() => new Promise(done => {
  // Zoom the shared x axis, then wait two animation frames, the same for both libraries:
  // Bokeh repaints in the next frame (its paint was requested before our callback, and the
  // last paint is long past, so its 60/s throttle does not delay it), Plotly redraws before
  // its promise resolves; the second frame starts once the first was produced.
  const frames = n => n ? requestAnimationFrame(() => frames(n - 1)) : done();
  if (window.Bokeh && Bokeh.documents.length) {
    Bokeh.documents[0].get_model_by_name('x').setv({start: 100, end: 5000});
    frames(2);
  } else if (window.Plotly && (document.getElementById('plots') || {}).data) {
    Plotly.relayout('plots', {'xaxis.range': [100, 5000]}).then(() => frames(2));
  } else {
    frames(2);
  }
})"""


def chromium_cpu() -> float:
    """CPU seconds used so far by this process's children (the browser and its renderer, GPU
    and utility processes, including those already exited and reaped): unlike wall time, it
    hardly depends on what else the machine runs."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = fields
            children.setdefault(int(fields[1]), []).append(int(d))
    total, todo = 0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        f = stats[pid]
        total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
        todo += children.get(pid, [])
    return total / tick


def render(paths: list[Path], runs: int = 3) -> list[dict[str, float]]:
    """Median seconds to each page drawn (`window.NANGUARD_READY`) and to a zoom painted, and
    the browser's CPU seconds over both, in headless Chromium; the pages are loaded in turn
    (`runs` rounds), so that a change of the machine's load hits them alike."""
    from playwright.sync_api import sync_playwright

    drawn: list[list[float]] = [[] for _ in paths]
    zoomed: list[list[float]] = [[] for _ in paths]
    cpu: list[list[float]] = [[] for _ in paths]
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for _ in range(runs):
            for i, path in enumerate(paths):
                ctx = b.new_context(viewport={"width": 1300, "height": 900})
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                c0 = chromium_cpu()
                t0 = time.perf_counter()
                page.goto(path.as_uri(), timeout=120_000)
                page.wait_for_function("window.NANGUARD_READY === true", timeout=120_000,
                                       polling=10)
                drawn[i].append(time.perf_counter() - t0)
                page.evaluate(ZOOM)
                zoomed[i].append(time.perf_counter() - t0)
                cpu[i].append(chromium_cpu() - c0)
                if errors:
                    raise RuntimeError(f"{path}: page errors: {errors[:3]}")
                ctx.close()
        b.close()
    def median(v: list[float]) -> float:
        return sorted(v)[len(v) // 2]

    return [{"drawn_s": median(d), "zoomed_s": median(z), "cpu_s": median(c)}
            for d, z, c in zip(drawn, zoomed, cpu, strict=True)]


def baselines(out: Path) -> list[tuple[str, Path]]:
    """Pages that only evaluate a library's JavaScript (and a blank page): the floor under a
    report's time, measured in the same run."""
    ready = "<script>window.NANGUARD_READY = true;</script>"
    pages = [("blank page", "")]
    from nanguard.show.html import bokeh_js

    pages.append(("bokeh.min.js alone", f"<script>{bokeh_js()}</script>"))
    try:
        from plotly.offline import get_plotlyjs

        pages.append(("plotly.min.js alone", f"<script>{get_plotlyjs()}</script>"))
    except ImportError:  # plotly is not a dependency any more; measured when installed
        pass
    out_pages = []
    for i, (name, script) in enumerate(pages):
        path = out / f"baseline{i}.html"
        path.write_text(f"<!DOCTYPE html><html><head>{script}</head><body>{ready}</body></html>")
        out_pages.append((name, path))
    return out_pages


def report_times(pages: list[tuple[str, Path]], runs: int) -> list[dict[str, float]]:
    """Render `pages` interleaved, print a table row per page; returns the medians."""
    times = render([p for _, p in pages], runs)
    for (name, path), r in zip(pages, times, strict=True):
        print(f"  {name}: {path.stat().st_size / 1e6:.2f} MB, drawn {r['drawn_s']:.2f} s, "
              f"zoomed {r['zoomed_s']:.2f} s, browser CPU {r['cpu_s']:.2f} s "
              f"(median of {runs})")
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--layers", type=int, default=300)
    ap.add_argument("--param-every", type=int, default=100,
                    help="per-layer rows every N steps (1: every step, the full 3e8 rows)")
    ap.add_argument("--out", default="", help="work folder (default: a temporary one)")
    ap.add_argument("--runs", type=int, default=3, help="loads of each page (median)")
    ap.add_argument("--pages", nargs="*", default=[], type=Path,
                    help="more HTML files timed in the same rounds (e.g. the Plotly report of "
                         "an earlier commit, written from the same run)")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="nanguard_html_bench_"))
    out.mkdir(parents=True, exist_ok=True)
    from nanguard.show.html import write_html

    run = out / "run"
    if (run / "run.db").is_file():
        print(f"run: reusing {run}")
    else:
        gen = make_run(run, args.steps, args.layers, args.param_every)
        n_param = math.ceil(args.steps / args.param_every) * args.layers
        print(f"run: {args.steps} steps, {args.layers} layers, {n_param} param_stats rows "
              f"(every {args.param_every} steps), generated in {gen:.1f} s")
    t0 = time.perf_counter()
    page = write_html([str(run)], out / "report.html")
    build = time.perf_counter() - t0
    size = page.stat().st_size
    print(f"build: {build:.1f} s; HTML {size / 1e6:.2f} MB")
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"chromium (load average before: {load}), pages loaded in turn:")
    pages = [("report", page), *((p.name, p) for p in args.pages), *baselines(out)]
    r = report_times(pages, args.runs)[0]
    with open("/proc/loadavg") as f:
        print(f"load average after: {' '.join(f.read().split()[:3])}")
    print(f"budget: size <= 10 MB {'OK' if size <= 10e6 else 'OVER'}; interactive <= 2 s "
          f"{'OK' if r['zoomed_s'] <= 2 else 'OVER'}")


if __name__ == "__main__":
    main()
