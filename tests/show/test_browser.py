"""The HTML report and the live dashboard in a real browser (headless Debian Chromium driven
by Playwright): no console errors, the finding visible, every plot drawn (colored pixels in
its frame), the non-finite step marked on every plot, one shared x range, a new step written
while the page is open shows up (and the user's zoom stays)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import Page
from helpers import child_env
from nanguard.show.html import write_html

# Helpers evaluated in the page: the Bokeh document drawn last (a live update replaces it),
# the views of its figures (named `row:...` by nanguard.show.plots) and what they painted.
JS = """
window.T = {
  doc: () => Bokeh.documents[Bokeh.documents.length - 1],
  models: () => [...T.doc().all_models],
  tagged: tag => T.models().filter(m => (m.tags || []).includes(tag)),
  xs: rs => [].concat(...rs.map(r => Array.from(r.data_source.get_column('x')))),
  figViews: () => {
    const out = [];
    const walk = v => {
      if ((v.model.name || '').startsWith('row:')) out.push(v);
      for (const c of v.child_views || []) walk(c);
    };
    for (const v of Bokeh.index.roots) walk(v);
    return out;
  },
  // Saturated pixels inside a figure's frame: drawn data (background, grid and axes are grey).
  colored: v => {
    const canvas = v.export('png', false).canvas;
    const f = v.frame.bbox;
    const px = canvas.getContext('2d').getImageData(f.left, f.top, f.width, f.height).data;
    let n = 0;
    for (let i = 0; i < px.length; i += 4) {
      const hi = Math.max(px[i], px[i + 1], px[i + 2]), lo = Math.min(px[i], px[i + 1], px[i + 2]);
      if (hi - lo > 40) n++;
    }
    return n;
  },
};
"""

# Screen position of a line's point (`[figure name, step]`) in the page.
POINT = """([name, step]) => {
  const v = T.figViews().find(v => v.model.name === name);
  const src = v.model.renderers.find(r => r.name === 'series').data_source;
  const xs = Array.from(src.get_column('xs')[0]), ys = src.get_column('ys')[0];
  const box = v.el.getBoundingClientRect();
  return {x: box.left + v.frame.x_scale.compute(step),
          y: box.top + v.frame.y_scale.compute(ys[xs.indexOf(step)]),
          value: ys[xs.indexOf(step)]};
}"""

TOOLTIPS = """() => {
  const out = [];
  const walk = n => {
    const c = n.shadowRoot && n.shadowRoot.querySelector('.bk-tooltip-content');
    if (c && c.innerText.trim()) out.push(c.innerText);
    for (const k of n.shadowRoot ? [...n.children, ...n.shadowRoot.children] : n.children) walk(k);
  };
  walk(document.body);
  return out;
}"""

PLOTS = """() => T.figViews().map(v => ({name: v.model.name, w: v.frame.bbox.width,
  h: v.frame.bbox.height, colored: T.colored(v), x: v.model.x_range.id}))"""

NONFINITE = """() => {
  const lines = T.doc().get_model_by_name('lines');  // not in the page when there is no event
  const kind = lines ? lines.get_column('kind') : [];
  const first = lines ? Array.from(lines.get_column('x'))
      .filter((x, i) => kind[i] === 'first_nonfinite') : [];
  const figs = T.models().filter(m => (m.name || '').startsWith('row:'));
  const marks = T.tagged('nonfinite');
  return {shapes: first, xs: T.xs(marks), nTraces: marks.length,
          withLines: figs.filter(f => f.renderers.some(r => r.data_source === lines)).length,
          nFigs: figs.length, heat: T.tagged('heat').length};
}"""


def _open(page: Page, url: str) -> Any:
    pg = page.open(url)
    pg.evaluate(f"() => {{ {JS} }}")
    return pg


def _check_plots(page: Any, empty: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every figure has a nonzero size, drew data (`empty`: may draw nothing) and shares the
    one x range (zoom one, all follow)."""
    plots = page.evaluate(PLOTS)
    names = [p["name"] for p in plots]
    assert len(plots) >= 8, names  # events, loss, grad norm, heat map, act, state, ratio, lr
    assert len({p["x"] for p in plots}) == 1, plots
    for p in plots:
        assert p["w"] > 500 and p["h"] > 40, p
        if p["name"] not in empty:
            # More than a few vertical event lines' worth of pixels: data was drawn.
            assert p["colored"] > (0 if p["name"] == "row:events" else 5 * p["h"]), p
    return plots


def test_failing_run_report(failing_run: Path, page: Page, tmp_path: Path) -> None:
    out = write_html([str(failing_run)], tmp_path / "failing.html")
    pg = _open(page, out.as_uri())
    assert page.errors == []
    # Self-contained: the page itself is the only thing loaded (no script, font or data fetched).
    assert {u for u in page.requests if not u.startswith("data:")} == {out.as_uri()}, page.requests
    finding = pg.locator(".finding")
    assert finding.is_visible() and "first non-finite at step 20" in finding.inner_text()
    assert pg.locator(".diagnosis .cause").first.is_visible()
    assert "data_nonfinite" in pg.locator(".diagnosis").inner_text()
    assert "fix:" in pg.locator(".diagnosis .fix").first.inner_text()
    _check_plots(pg)
    nf = pg.evaluate(NONFINITE)
    assert nf["shapes"] == [20], nf  # the first non-finite step, across every plot
    assert nf["withLines"] == nf["nFigs"], nf
    assert 20 in nf["xs"] and nf["nTraces"] >= 4, nf
    assert nf["heat"] == 1
    # Activation headroom (float32 here) with the NaN activation of step 20 marked on it.
    head = pg.evaluate("""() => T.doc().get_model_by_name('row:act_headroom').renderers
      .filter(r => (r.tags || []).includes('nonfinite')).map(r => T.xs([r]))""")
    assert head == [[20]], head
    # Hovering a point of the loss shows its run, step and value.
    pt = pg.evaluate(POINT, ["row:loss", 5])
    pg.mouse.move(pt["x"], pt["y"] + 40)
    pg.mouse.move(pt["x"], pt["y"])
    pg.wait_for_function(f"({TOOLTIPS})().length > 0", timeout=10_000)
    tip = " ".join(pg.evaluate(TOOLTIPS)).split()
    assert tip[:3] == ["failing", "step:", "5"], tip
    assert float(tip[-1]) == float(f"{pt['value']:.4g}"), tip
    # A zoom of one figure is the zoom of all: they share the x range.
    pg.evaluate("() => T.doc().get_model_by_name('x').setv({start: 10, end: 30})")
    pg.wait_for_function("() => T.figViews().every(v => v.frame.x_scale.source_range.start === 10)")
    pg.screenshot(path=str(tmp_path / "failing.png"), full_page=True)


def test_healthy_run_report(healthy_run: Path, page: Page, tmp_path: Path) -> None:
    out = write_html([str(healthy_run)], tmp_path / "healthy.html")
    pg = _open(page, out.as_uri())
    assert page.errors == []
    assert pg.locator(".run .status").inner_text() == "healthy"
    assert pg.locator(".finding").count() == 0
    _check_plots(pg, empty=("row:events",))  # no alarm, action or non-finite value
    nf = pg.evaluate(NONFINITE)
    assert nf["shapes"] == [] and nf["xs"] == []


def test_compare_and_merged(failing_run: Path, healthy_run: Path, merged_run: Path,
                            page: Page, tmp_path: Path) -> None:
    out = write_html([str(failing_run), str(healthy_run), str(merged_run)],
                     tmp_path / "compare.html")
    pg = _open(page, out.as_uri())
    assert page.errors == []
    assert pg.locator(".run").count() == 3
    names = pg.evaluate("() => [].concat(...T.models().filter(m => m.name === 'series')"
                        ".map(r => Array.from(r.data_source.get_column('name'))))")
    # One line per run, and one per part of the merged run.
    assert {"failing", "healthy", "gan/gen", "gan/disc"} <= set(names), names
    assert pg.evaluate("() => T.tagged('heat').length") == 4
    assert sorted(pg.evaluate(NONFINITE)["shapes"]) == [20, 25]
    _check_plots(pg)


def test_dashboard_live_update(healthy_run: Path, page: Page, tmp_path: Path) -> None:
    """A run still training (its writer open): the open page shows a step written later."""
    from nanguard.cli.dashboard import serve
    from nanguard.record.store import RunStore

    store = RunStore(tmp_path / "runs" / "live")
    for s in range(30):
        store.write_step({"step": s, "loss": 1.0 / (s + 1), "grad_norm": 1.0, "lr": 0.1},
                         params=[(0, 1.0, 2.0, {"exp_avg": 0.1})])
    store.flush()  # steps are committed in batches (record/store.py)
    server = serve(str(tmp_path / "runs"), 0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        index = page.page
        index.goto(base + "/")
        assert index.locator("#runs a").inner_text() == "live"
        assert "running" in index.locator("#runs").inner_text()
        pg = _open(page, base + "/run?path=live")
        assert "last step 29" in pg.locator("#meta").inner_text()
        pg.evaluate("() => T.doc().get_model_by_name('x').setv({start: 5, end: 25})")
        store.write_step({"step": 30, "loss": float("nan"), "grad_norm": 1.0, "lr": 0.1},
                         params=[(0, float("nan"), 2.0, {"exp_avg": float("nan")})])
        pg.wait_for_function("document.getElementById('meta').textContent"
                             ".includes('last step 30')", timeout=20_000)
        pg.wait_for_function("window.NANGUARD_READY && Bokeh.documents.length === 1")
        assert 30 in pg.evaluate("() => T.xs(T.tagged('nonfinite'))")
        # Redrawn with the new step, the user's zoom kept.
        x = pg.evaluate("() => [T.doc().get_model_by_name('x').start,"
                        " T.doc().get_model_by_name('x').end]")
        assert x == [5, 25], x
        assert pg.evaluate("() => T.figViews().length") >= 4
        assert page.errors == []
    finally:
        server.shutdown()
        server.server_close()
        store.close()


def test_dashboard_stops_on_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanguard", "dashboard", str(tmp_path), "--port", "0"],
        stderr=subprocess.PIPE, text=True,
        env=child_env(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1"),
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            # Seen once under CI load (20 s then), not reproduced: say where it hung. The
            # kernel's view (state, blocked / ignored signals), then every thread's stack
            # (the fault handler prints them on SIGABRT).
            status = Path(f"/proc/{proc.pid}/status").read_text()
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=30)
            pytest.fail(f"the dashboard did not stop on Ctrl-C in 60 s\n{status}\n{err}")
        assert code == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dashboard_bad_dir(tmp_path: Path) -> None:
    from nanguard.cli.main import main

    assert main(["dashboard", str(tmp_path / "missing")]) == 2
