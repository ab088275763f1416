"""The run store itself (record/store.py, writer.py, compact.py), through its real write path.

- what the hot path queues is not committed until the writer's batch; alarms, actions and
  findings are committed (with everything queued before them) before their call returns;
- NaN stays NaN and inf stays inf through the per-step blob and the `param_stats` view;
- a store written by the old schema (a real `param_stats` table, one row per parameter) reads
  as before and, reopened for writing, shows its old rows and the new ones through the view;
- a writer failure never raises on its thread: it is kept, the next call raises StoreError, and
  `close()` does not raise;
- compaction keeps alarms' windows and recent steps, real rows only, min/max/last per bucket,
  and never loses a non-finite count.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time

import pytest

from nanguard import load_report
from nanguard.detect.alarm import Alarm
from nanguard.record.rows import write_step
from nanguard.record.store import RunStore, StoreError, dec, open_run, step_count
from nanguard.watch.stats import StepStats

# The schema of stores written before param_blobs (copied from record/store.py at 109a203).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS params (id INTEGER PRIMARY KEY, name TEXT, shape TEXT, numel INTEGER);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, time REAL, loss, grad_norm, param_norm, update_ratio,
    momentum_norm, act_max, lr, nonfinite TEXT, skipped INTEGER, amp_scale, act_limit);
CREATE TABLE IF NOT EXISTS param_stats (
    step INTEGER, param_id INTEGER, grad_norm, param_norm, state TEXT,
    PRIMARY KEY (step, param_id));
CREATE TABLE IF NOT EXISTS activations (step INTEGER, module TEXT, absmax,
    PRIMARY KEY (step, module));
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, fingerprint TEXT, samples TEXT,
    nonfinite_samples TEXT);
CREATE TABLE IF NOT EXISTS rng (step INTEGER PRIMARY KEY, state BLOB);
CREATE TABLE IF NOT EXISTS alarms (step INTEGER, kind TEXT, signal TEXT, value, message TEXT);
CREATE TABLE IF NOT EXISTS actions (step INTEGER, action TEXT, detail TEXT);
CREATE TABLE IF NOT EXISTS findings (id INTEGER PRIMARY KEY, body TEXT);
"""

NAN, INF = math.nan, math.inf
QUIET = {"flush_steps": 10_000, "flush_seconds": 3600.0}  # the writer never wakes by itself


def _stats(step: int, **kw) -> StepStats:
    base = {"loss": 1.0, "lr": 1e-3, "grad_norms": {0: 0.5, 1: 2.0},
            "param_norms": {0: 1.0, 1: 3.0},
            "state_norms": {"exp_avg": {0: 0.1, 1: 0.2}, "exp_avg_sq": {0: 1e-4, 1: 2e-4}}}
    return StepStats(step=step, **{**base, **kw})


def _read(folder, sql: str, *args) -> list[tuple]:
    db = sqlite3.connect(f"{(folder / 'run.db').resolve().as_uri()}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def test_steps_are_queued_and_events_committed_before_returning(tmp_path):
    store = RunStore(tmp_path, **QUIET)
    for s in range(5):
        write_step(store, _stats(s), 2, True)
    # Queued on the hot path: nothing of it is in the file yet.
    assert _read(tmp_path, "SELECT count(*) FROM steps") == [(0,)]
    store.write_alarm(Alarm(step=4, kind="spike", signal="grad_norm", value=9.0,
                            message="m").to_dict())
    # The alarm is committed, after the steps queued before it.
    assert _read(tmp_path, "SELECT count(*) FROM steps") == [(5,)]
    assert _read(tmp_path, "SELECT step, kind FROM alarms") == [(4, "spike")]
    store.write_action(5, "skip", "why")
    write_step(store, _stats(5, skipped=True), 2, True)  # the step the action was about
    assert _read(tmp_path, "SELECT step, skipped FROM steps WHERE step = 5") == [(5, 1)]
    write_step(store, _stats(6), 2, True)
    write_step(store, _stats(7, loss=NAN), 2, True)  # a non-finite step: committed at once
    assert _read(tmp_path, "SELECT step FROM steps WHERE step >= 6") == [(6,), (7,)]
    write_step(store, _stats(8), 2, True)
    assert _read(tmp_path, "SELECT max(step) FROM steps") == [(7,)]
    store.close()
    assert _read(tmp_path, "SELECT max(step) FROM steps") == [(8,)]
    store.close()  # idempotent


def test_a_run_that_stays_nan_commits_its_first_nan_step_only(tmp_path):
    """A NaN at every step (`observe` goes on): the first non-finite step is committed at once,
    the repeats (same signals) are queued like plain steps; new signals commit again. Nothing
    is lost at close."""
    store = RunStore(tmp_path, **QUIET)
    write_step(store, _stats(0), 2, True)
    write_step(store, _stats(1, loss=NAN), 2, True)  # new: committed at once
    assert _read(tmp_path, "SELECT max(step) FROM steps") == [(1,)]
    for s in range(2, 6):
        write_step(store, _stats(s, loss=NAN), 2, True)  # the same signals: queued
    assert _read(tmp_path, "SELECT max(step) FROM steps") == [(1,)]
    write_step(store, _stats(6, loss=NAN, grad_norms={0: NAN}, nonfinite_grads=[0]), 2,
               True)  # a new signal
    assert _read(tmp_path, "SELECT max(step) FROM steps") == [(6,)]
    store.close()
    assert _read(tmp_path, "SELECT count(*) FROM steps WHERE nonfinite != '[]'") == [(6,)]


def test_nan_and_inf_survive_the_blob_and_the_view(tmp_path):
    store = RunStore(tmp_path, **QUIET)
    write_step(store, _stats(0, grad_norms={0: NAN, 2: INF}, param_norms={0: -INF, 1: 1.5, 2: 2.0},
                             state_norms={"exp_avg": {0: NAN, 1: INF}, "exp_avg_sq": {1: 0.25}}),
               3, True)
    store.close()
    db = open_run(tmp_path)
    try:
        rows = db.execute("SELECT param_id, grad_norm, param_norm, state, typeof(grad_norm) "
                          "FROM param_stats WHERE step = 0 ORDER BY param_id").fetchall()
    finally:
        db.close()
    assert [r[0] for r in rows] == [0, 1, 2]
    (_, g0, p0, s0, t0), (_, g1, p1, s1, _), (_, g2, p2, s2, t2) = rows
    assert g0 == "nan" and t0 == "text" and math.isnan(dec(g0))  # NaN as 'nan', like enc()
    assert g1 is None  # no gradient: NULL, as before
    assert g2 == INF and t2 == "real"  # inf as REAL, like enc()
    assert dec(p0) == -INF and dec(p1) == 1.5 and dec(p2) == 2.0
    assert json.loads(s0) == {"exp_avg": "nan"}  # absent keys stay absent
    assert json.loads(s1) == {"exp_avg": "inf", "exp_avg_sq": 0.25}
    assert json.loads(s2) == {}


def _old_store(folder) -> None:
    folder.mkdir()
    db = sqlite3.connect(folder / "run.db")
    db.executescript(OLD_SCHEMA)
    db.executemany("INSERT INTO steps (step, time, loss, nonfinite, skipped) VALUES (?,?,?,?,?)",
                   [(s, 0.0, "nan" if s == 2 else 1.0, '["loss"]' if s == 2 else "[]", 0)
                    for s in range(3)])
    db.executemany("INSERT INTO param_stats VALUES (?,?,?,?,?)",
                   [(s, i, "nan" if s == 2 else 0.5, INF if i else 1.0,
                     json.dumps({"exp_avg": "nan" if s == 2 else 0.1})) for s in range(3)
                    for i in range(2)])
    db.commit()
    db.close()


def test_old_store_reads_and_reopens(tmp_path):
    folder = tmp_path / "old"
    _old_store(folder)
    query = "SELECT step, param_id, grad_norm, param_norm, state FROM param_stats ORDER BY 1, 2"
    before = _read(folder, query)
    assert len(before) == 6 and before[4][2] == "nan" and before[1][3] == INF
    from nanguard.show.series import load_series

    assert load_series(folder, "old").last_step == 2
    store = RunStore(folder, **QUIET)  # reopened for writing: the old table is kept
    write_step(store, _stats(3), 2, True)
    store.close()
    after = _read(folder, query)
    assert after[:6] == before
    assert [r[:2] for r in after[6:]] == [(3, 0), (3, 1)]
    assert _read(folder, "SELECT type FROM sqlite_master WHERE name = 'param_stats'") == [
        ("view",)]
    assert load_series(folder, "old").last_step == 3


def test_writer_failure_is_kept_and_raised_on_the_next_call(tmp_path, capsys):
    store = RunStore(tmp_path, flush_steps=2, flush_seconds=3600.0)
    write_step(store, _stats(0), 2, True)
    store.write_step({"step": 1, "loss": "not a number"})  # enc() fails on the writer thread
    for _ in range(500):  # the writer thread wakes at 2 queued items
        if store.error is not None:
            break
        time.sleep(0.01)
    assert isinstance(store.error, TypeError)
    with pytest.raises(StoreError, match="stopped writing"):
        write_step(store, _stats(2), 2, True)
    with pytest.raises(StoreError):
        store.write_alarm(Alarm(step=2, kind="spike", signal="grad_norm", value=1.0,
                                message="m").to_dict())
    store.close()  # never raises
    assert "stopped writing" in capsys.readouterr().err
    assert open_run(tmp_path).execute("SELECT count(*) FROM steps").fetchone()[0] == 0


def test_compaction_keeps_windows_recent_steps_and_nonfinite_counts(tmp_path):
    store = RunStore(tmp_path, flush_steps=16, flush_seconds=0.01, keep_recent=100, bucket=50,
                     window=5)
    losses = {}
    for s in range(600):
        loss = NAN if s in (77, 78) else 10.0 / (s + 1) + (5.0 if s == 133 else 0.0)
        losses[s] = loss
        stats = _stats(s, loss=loss, grad_norms={0: 0.5 + (s % 9), 1: 2.0})
        if s == 250:
            stats.alarms = [Alarm(step=s, kind="spike", signal="grad_norm", value=9.0,
                                  message="m")]
        write_step(store, stats, 2, True)
        if s % 100 == 0:
            store.write_rng(s, b"state")
    store.flush()
    for _ in range(1000):  # compaction runs on the writer thread after its commits
        if store.error is not None or _read(
                tmp_path, "SELECT value FROM store_state WHERE key = 'compacted'") == [(500,)]:
            break
        time.sleep(0.01)
    store.close()
    db = open_run(tmp_path)
    try:
        steps = [s for (s,) in db.execute("SELECT step FROM steps ORDER BY step")]
        buckets = {b[0]: b for b in db.execute("SELECT * FROM step_buckets")}
        assert step_count(db) == 600
        per_param = {s for (s,) in db.execute("SELECT DISTINCT step FROM param_stats")}
        rng = [s for (s,) in db.execute("SELECT step FROM rng")]
    finally:
        db.close()
    assert load_report(tmp_path).steps == 600  # a died run's report counts compacted steps
    assert set(range(500, 600)) <= set(steps)  # the recent steps
    assert set(range(245, 256)) <= set(steps)  # the alarm's window
    assert len(steps) < 250, "nothing was compacted"
    # A bucket: real rows only (the last, the first non-finite, argmin/argmax of each signal).
    first, last, n, kept, nonfinite_steps, _skipped, nonfinite, signals = buckets[50]
    assert (first, last, n, nonfinite_steps, json.loads(nonfinite)) == (50, 99, 50, 2, ["loss"])
    inside = [s for s in steps if 50 <= s <= 99]
    assert len(inside) == kept and 99 in inside and 77 in inside
    loss = json.loads(signals)["loss"]
    finite = [losses[s] for s in range(50, 100) if math.isfinite(losses[s])]
    assert loss[:2] == [min(finite), max(finite)] and loss[3:] == [2, 0]
    assert loss[2] == losses[99]
    assert 133 in steps  # the loss bump is the max of its bucket: kept as a real row
    assert {99, 77} <= per_param and 0 in rng
    # The window splits bucket 200..249 / 250..299 around the alarm.
    assert buckets[200][1] == 244 and buckets[256][1] == 299


def test_a_store_dropped_without_close_writes_its_steps_and_ends_its_thread(tmp_path):
    import gc
    import threading

    store = RunStore(tmp_path, **QUIET)
    for s in range(3):
        write_step(store, _stats(s), 2, True)
    thread = store._writer._thread
    del store
    gc.collect()
    assert not thread.is_alive()
    assert not any(t is thread for t in threading.enumerate())
    assert _read(tmp_path, "SELECT count(*) FROM steps") == [(3,)]


def test_writing_after_close_raises(tmp_path):
    store = RunStore(tmp_path, **QUIET)
    store.close()
    with pytest.raises(StoreError, match="closed"):
        write_step(store, _stats(0), 2, True)
    with pytest.raises(StoreError, match="closed"):
        store.write_action(0, "skip", "why")
    assert store.error is None


@pytest.mark.bench  # a benchmark's smoke test: CI runs it (-m bench)
def test_store_benchmark_runs(tmp_path):
    """benchmarks/store.py end to end on a few steps (its output's shape, no timing)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for mode in ("hot", "long"):
        proc = subprocess.run([sys.executable, str(root / "benchmarks" / "store.py"), mode,
                               "--steps", "300", "--params", "2"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["mode"] == mode and result["steps"] == 300
        row = result["2"] if mode == "hot" else result
        assert row["caller_us"] > 0 and row["total_us"] >= row["caller_us"] * 0.5
        assert row["closed_bytes"] > 0
    assert not list(tmp_path.iterdir())  # the runs went to a temporary directory
