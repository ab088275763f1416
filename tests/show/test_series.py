"""Bucketing of long series (a NaN is never averaged away) and the run-store reader."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np

from nanguard.cli.main import main
from nanguard.show.series import bucket_width, bucketize, load_series


def test_bucketize_keeps_nan_and_exact_min_max() -> None:
    steps = np.arange(100)
    values = np.arange(100, dtype=float) + 1.0
    values[37] = np.nan
    values[38] = np.inf
    values[90] = -np.inf
    b = bucketize(steps, values, origin=0, width=10)
    assert len(b) == 10
    assert b.step.tolist() == list(range(0, 100, 10))
    # min / max of the finite values per bucket, exactly.
    for i in range(10):
        chunk = values[i * 10:(i + 1) * 10]
        fin = chunk[np.isfinite(chunk)]
        assert b.lo[i] == fin.min() and b.hi[i] == fin.max()
        assert b.nonfinite[i] == int((~np.isfinite(chunk)).sum())
    # The NaN survives: counted, its step and value kept.
    assert b.nonfinite[3] == 2 and b.bad_step[3] == 37 and math.isnan(b.bad_value[3])
    assert b.nonfinite[9] == 1 and b.bad_step[9] == 90 and b.bad_value[9] == -np.inf
    assert b.bad_step[0] == -1 and b.nonfinite[0] == 0
    assert b.last[4] == 50.0


def test_bucketize_all_nonfinite_bucket_and_last() -> None:
    b = bucketize([0, 1, 2, 3], [1.0, 2.0, np.nan, np.nan], origin=0, width=2)
    assert b.lo[0] == 1.0 and b.hi[0] == 2.0
    assert math.isnan(b.lo[1]) and math.isnan(b.hi[1]) and math.isnan(b.last[1])
    assert b.nonfinite.tolist() == [0, 2] and b.bad_step.tolist() == [-1, 2]


def test_bucketize_gaps_and_width() -> None:
    assert bucket_width(0, 999_999, 2000) == 500
    assert bucket_width(5, 5, 2000) == 1
    b = bucketize([0, 1, 50, 51], [1, 2, 3, 4], origin=0, width=10)
    assert b.step.tolist() == [0, 50] and b.hi.tolist() == [2, 4]
    assert len(bucketize([], [], width=3)) == 0


def test_load_series_failing_run(failing_run: Path) -> None:
    r = load_series(failing_run, "f")
    loss = r.steps["loss"]
    assert loss.nonfinite[20] == 1 and loss.bad_step[20] == 20
    assert r.grad_heat is not None and r.grad_heat.nonfinite[:, 20].all()
    # The optimizer state is sampled (every 10 steps, every step of an alarm episode): its
    # series holds the steps that measured it, step 20 among them.
    assert "exp_avg" in r.state
    moment = r.state["exp_avg"]
    assert moment.bad_step[moment.step.tolist().index(20)] == 20
    assert r.activations and any(b.nonfinite.sum() for b in r.activations.values())
    # Downsampled to 4 buckets the NaN at step 20 is still there.
    r = load_series(failing_run, "f", width=10)
    assert r.steps["loss"].nonfinite.tolist()[2] == 10
    assert r.steps["loss"].bad_step.tolist()[2] == 20


def test_report_html_cli(failing_run: Path, healthy_run: Path, tmp_path: Path) -> None:
    assert main(["report", str(failing_run), "--html"]) == 1  # failed: exit code kept
    page = (failing_run / "report.html").read_text()
    assert "<script src=" not in page and "data_nonfinite" in page
    assert main(["report", str(healthy_run), "--html", str(tmp_path / "h.html")]) == 0
    h = (tmp_path / "h.html").read_text()
    assert len(h) > 1_000_000 and "BEGIN bokeh.min.js" in h  # BokehJS inlined
    out = tmp_path / "both.html"
    assert main(["report", str(failing_run), str(healthy_run), "--html", str(out)]) == 1
    assert out.is_file()


def test_report_html_bad_input(tmp_path: Path, healthy_run: Path, capsys) -> None:
    assert main(["report", str(tmp_path / "nope"), "--html"]) == 2
    (tmp_path / "x").mkdir()
    assert main(["report", str(tmp_path / "x"), "--html"]) == 2
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "run.db").write_bytes(b"not a database" * 100)
    assert main(["report", str(bad), "--html"]) == 2
    # report.json fine, run.db corrupt: still one line, exit 2.
    both = tmp_path / "corrupt2"
    both.mkdir()
    (both / "report.json").write_text((healthy_run / "report.json").read_text())
    (both / "run.db").write_bytes(b"garbage" * 100)
    assert main(["report", str(both), "--html", str(tmp_path / "o.html")]) == 2
    assert main(["report", str(healthy_run), str(healthy_run), "--html"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("nanguard report: error:") for line in err)


def test_store_read_only_while_writer_open(tmp_path: Path) -> None:
    from nanguard.record.store import RunStore

    store = RunStore(tmp_path / "live")
    store.write_step({"step": 0, "loss": 1.0})
    store.write_step({"step": 1, "loss": float("nan")})
    store.flush()  # steps are committed in batches (record/store.py)
    r = load_series(tmp_path / "live", "live")
    assert r.steps["loss"].nonfinite.tolist() == [0, 1]
    store.write_step({"step": 2, "loss": 0.5})  # the reader never blocked the writer
    store.flush()
    assert load_series(tmp_path / "live", "live").last_step == 2
    store.close()
    assert sqlite3.connect(tmp_path / "live" / "run.db").execute(
        "SELECT count(*) FROM steps").fetchone()[0] == 3


OLD_STEPS = """CREATE TABLE steps (
    step INTEGER PRIMARY KEY, time REAL, loss, grad_norm, param_norm, update_ratio,
    momentum_norm, act_max, lr, nonfinite TEXT, skipped INTEGER)"""


def test_store_written_before_amp_scale_opens(tmp_path: Path) -> None:
    """A run.db from before the amp_scale / act_limit columns: read as is (no loss-scale or
    headroom series), drawn, and given the columns when reopened for writing."""
    from nanguard.record.store import SCHEMA, RunStore, step_columns
    from nanguard.show.html import write_html

    folder = tmp_path / "old"
    folder.mkdir()
    db = sqlite3.connect(folder / "run.db")
    db.executescript(SCHEMA.replace(SCHEMA[SCHEMA.index("CREATE TABLE IF NOT EXISTS steps"):
                                           SCHEMA.index("CREATE TABLE IF NOT EXISTS param_stats")],
                                    OLD_STEPS + ";\n"))
    db.executemany("INSERT INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                   [(s, 0.0, 1.0, 1.0, 1.0, None, None, 2.0, 0.1, "[]", 0) for s in range(5)])
    db.commit()
    assert "amp_scale" not in step_columns(db)
    db.close()
    r = load_series(folder, "old")
    assert r.last_step == 4 and "loss" in r.steps
    assert "amp_scale" not in r.steps and "act_headroom" not in r.steps
    assert write_html([str(folder)], tmp_path / "old.html").is_file()
    store = RunStore(folder)
    store.write_step({"step": 5, "loss": 1.0, "amp_scale": 1024.0})
    store.close()
    r = load_series(folder, "old")
    assert r.steps["amp_scale"].step.tolist() == [5] and r.last_step == 5


def test_amp_scale_and_headroom_written_and_plotted(tmp_path: Path) -> None:
    from nanguard.record.rows import write_step
    from nanguard.record.store import RunStore
    from nanguard.show.html import build_layout, load_sources, payload
    from nanguard.watch.stats import StepStats

    store = RunStore(tmp_path / "amp")
    for s in range(10):
        act = float("nan") if s == 7 else 10.0 ** s
        stats = StepStats(step=s, loss=1.0, amp_scale=float("nan") if s == 8 else 2.0 ** (16 - s),
                          activations={"fc": act}, act_limit=65504.0)
        write_step(store, stats, 0, per_parameter=False)
    store.close()
    r = load_series(tmp_path / "amp", "amp")
    assert r.steps["amp_scale"].last.tolist()[:3] == [65536.0, 32768.0, 16384.0]
    head = r.steps["act_headroom"]
    assert r.act_limit == 65504.0
    assert head.last[0] == math.log10(65504.0)  # abs-max 1: log10(limit) decades left
    assert head.last[5] < 0  # 1e5 > 65504: overflowed
    assert head.nonfinite.tolist()[7] == 1 and head.last[7] == -np.inf
    assert r.steps["amp_scale"].bad_step.tolist()[8] == 8
    sources = load_sources([str(tmp_path / "amp")])
    assert payload(sources)["plot"] is not None
    layout = build_layout(sources, [load_series(tmp_path / "amp", "amp")])
    figs = {child[0].name: child[0] for child in layout.children}
    assert "dtype limit 6.55e+04" in figs["row:activations"].title.text
    assert "activation headroom" in figs["row:act_headroom"].title.text
    assert figs["row:amp_scale"].title.text == "AMP loss scale (GradScaler)"

    def marked(fig: Any) -> list[int]:
        return [x for r in fig.renderers if "nonfinite" in r.tags
                for x in r.data_source.data["x"]]

    assert marked(figs["row:act_headroom"]) == [7]
    assert marked(figs["row:amp_scale"]) == [8]
    # The first non-finite step (of the report) is a line on every figure.
    lines = [r for r in figs["row:loss"].renderers if r.data_source.name == "lines"]
    assert len(lines) == 1 and all(
        any(r.data_source is lines[0].data_source for r in f.renderers) for f in figs.values())


def test_nonfinite_run_one_marker_and_a_segment() -> None:
    """A series that stays NaN: one marker at its first non-finite step and a segment over
    every later bucket (none dropped, no wall of crosses)."""
    from nanguard.show.markers import bad_markers

    v = np.ones(100)
    v[3] = np.nan
    v[60:] = np.nan
    b = bucketize(np.arange(100), v, width=5)
    xs, _, texts, seg_x, _ = bad_markers(b)
    assert xs == [3, 60]
    assert seg_x == [60, 95, None]
    assert "40 non-finite in steps 60.." in texts[1]


def test_demo_ends_with_the_html_report_command(tmp_path: Path, capsys) -> None:
    """`nanguard demo` ends by pointing at the HTML report of a failing seed; the command it
    prints works."""
    import shlex

    assert main(["demo", "--seeds", "1", "--out", str(tmp_path / "demo")]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("See failing seed 0 in a browser: nanguard report "), last
    cmd = shlex.split(last.split(": ", 1)[1].split("  (writes")[0])
    assert cmd[0] == "nanguard" and cmd[-1] == "--html"
    assert main(cmd[1:]) == 1  # the seed failed: report's exit code
    assert (tmp_path / "demo" / "seed-0" / "report.html").is_file()


def test_infinite_values_are_gaps_and_markers() -> None:
    """+-Inf in a series is a gap in its line (an infinite value would stretch the figure's
    automatic y range to infinity and hide every finite point) and a non-finite marker."""
    from nanguard.show.plots import Lines

    lines = Lines()
    lines.add(bucketize(range(6), [1.0, 2.0, np.inf, 3.0, 4.0, -np.inf]), "loss", "#000")
    ys = lines.line["ys"][0]
    assert np.isnan(ys[2]) and np.isnan(ys[5]) and ys[3] == 3.0
    assert np.isfinite(np.nan_to_num(ys, nan=0.0)).all()
    assert lines.mark["x"] == [2, 5] and "inf at step 2" in lines.mark["text"][0]
