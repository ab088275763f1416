"""Bucketing of long series (a NaN is never averaged away) and the run-store reader."""

from __future__ import annotations

import math
import sqlite3
from pathlib import Path

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
    assert "exp_avg" in r.state and r.state["exp_avg"].bad_step[20] == 20
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
    assert (tmp_path / "h.html").stat().st_size > 1_000_000  # plotly.js inlined
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
    r = load_series(tmp_path / "live", "live")
    assert r.steps["loss"].nonfinite.tolist() == [0, 1]
    store.write_step({"step": 2, "loss": 0.5})  # the reader never blocked the writer
    assert load_series(tmp_path / "live", "live").last_step == 2
    store.close()
    assert sqlite3.connect(tmp_path / "live" / "run.db").execute(
        "SELECT count(*) FROM steps").fetchone()[0] == 3
