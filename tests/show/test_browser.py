"""The HTML report and the live dashboard in a real browser (headless Debian Chromium driven
by Playwright): no console errors, the finding visible, every plot drawn, the non-finite step
marked, a new step written while the page is open shows up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from conftest import Page
from nanguard.show.html import write_html

PLOTS = """() => {
  const out = [];
  for (const sp of document.querySelectorAll('#plots .cartesianlayer .subplot')) {
    const name = sp.classList[1];
    const drag = document.querySelector('#plots .draglayer > g.' + name + ' rect.nsewdrag');
    const r = drag.getBoundingClientRect();
    const drawn = sp.querySelectorAll('path.js-line, .points path').length;
    out.push({name, w: r.width, h: r.height, drawn});
  }
  return out;
}"""

NONFINITE = """() => {
  const div = document.getElementById('plots');
  const shapes = (div.layout.shapes || []).filter(s => s.name === 'first non-finite')
      .map(s => s.x0);
  const traces = div.data.filter(t => t.meta === 'nonfinite');
  const xs = [].concat(...traces.map(t => t.x));
  const points = document.querySelectorAll('#plots .scatterlayer .trace .points path').length;
  return {shapes, xs, nTraces: traces.length, points,
          heat: document.querySelectorAll('#plots .heatmaplayer image').length};
}"""


def _check_plots(page: Any, empty: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Every subplot has a nonzero size and drew something (`empty`: may draw nothing)."""
    plots = page.evaluate(PLOTS)
    assert len(plots) >= 7, plots  # events, loss, grad norm, heat map, act, state, ratio, lr
    for p in plots:
        assert p["w"] > 100 and p["h"] > 20, p
        if p["name"] not in ("x4y4", *empty):  # the heat map draws an <image> (checked apart)
            assert p["drawn"] > 0, p
    return plots


def test_failing_run_report(failing_run: Path, page: Page, tmp_path: Path) -> None:
    out = write_html([str(failing_run)], tmp_path / "failing.html")
    pg = page.open(out.as_uri())
    assert page.errors == []
    finding = pg.locator(".finding")
    assert finding.is_visible() and "first non-finite at step 20" in finding.inner_text()
    assert pg.locator(".diagnosis .cause").first.is_visible()
    assert "data_nonfinite" in pg.locator(".diagnosis").inner_text()
    assert "fix:" in pg.locator(".diagnosis .fix").first.inner_text()
    _check_plots(pg)
    nf = pg.evaluate(NONFINITE)
    assert nf["shapes"] == [20], nf  # the first non-finite step, across every plot
    assert 20 in nf["xs"] and nf["nTraces"] >= 4 and nf["points"] > 0, nf
    assert nf["heat"] == 1
    # Activation headroom (float32 here) with the NaN activation of step 20 marked on it.
    head = pg.evaluate("""() => {
      const div = document.getElementById('plots');
      const i = div.layout.annotations.findIndex(a => a.text.includes('headroom'));
      const ax = 'y' + (i ? i + 1 : '');
      return div.data.filter(t => t.yaxis === ax && t.meta === 'nonfinite').map(t => t.x);
    }""")
    assert head == [[20]], head
    pg.screenshot(path=str(tmp_path / "failing.png"), full_page=True)


def test_healthy_run_report(healthy_run: Path, page: Page, tmp_path: Path) -> None:
    out = write_html([str(healthy_run)], tmp_path / "healthy.html")
    pg = page.open(out.as_uri())
    assert page.errors == []
    assert pg.locator(".run .status").inner_text() == "healthy"
    assert pg.locator(".finding").count() == 0
    _check_plots(pg, empty=("xy",))  # no alarm, action or non-finite value: no event
    nf = pg.evaluate(NONFINITE)
    assert nf["shapes"] == [] and nf["xs"] == []


def test_compare_and_merged(failing_run: Path, healthy_run: Path, merged_run: Path,
                            page: Page, tmp_path: Path) -> None:
    out = write_html([str(failing_run), str(healthy_run), str(merged_run)],
                     tmp_path / "compare.html")
    pg = page.open(out.as_uri())
    assert page.errors == []
    assert pg.locator(".run").count() == 3
    names = pg.evaluate("() => document.getElementById('plots').data"
                        ".filter(t => t.showlegend && t.legendgroup).map(t => t.legendgroup)")
    # One trace per run, and one per part of the merged run.
    assert {"failing", "healthy", "gan/gen", "gan/disc"} <= set(names), names
    assert pg.evaluate("() => document.querySelectorAll('.heatmaplayer image').length") == 4
    shapes = pg.evaluate("() => document.getElementById('plots').layout.shapes"
                         ".filter(s => s.name === 'first non-finite').map(s => s.x0)")
    assert sorted(shapes) == [20, 25]


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
        pg = page.open(base + "/run?path=live")
        assert "last step 29" in pg.locator("#meta").inner_text()
        store.write_step({"step": 30, "loss": float("nan"), "grad_norm": 1.0, "lr": 0.1},
                         params=[(0, float("nan"), 2.0, {"exp_avg": float("nan")})])
        pg.wait_for_function("document.getElementById('meta').textContent"
                             ".includes('last step 30')", timeout=20_000)
        xs = pg.evaluate("() => [].concat(...document.getElementById('plots').data"
                         ".filter(t => t.meta === 'nonfinite').map(t => t.x))")
        assert 30 in xs
        assert page.errors == []
    finally:
        server.shutdown()
        server.server_close()
        store.close()


def test_dashboard_stops_on_ctrl_c(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "nanguard", "dashboard", str(tmp_path), "--port", "0"],
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "http://127.0.0.1:" in line, line
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_dashboard_bad_dir(tmp_path: Path) -> None:
    from nanguard.cli.main import main

    assert main(["dashboard", str(tmp_path / "missing")]) == 2
