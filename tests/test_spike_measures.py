"""Spike measures (`nanguard.record.spikes`): spike score, episodes and time in spike against
hand-computed values and an independent numpy implementation of the same definition; the
rolling window's exactness; edge cases (fewer steps than the minimum window, a constant series,
NaN, a spike the run ends in); the meter's state round trip; and the measures read from a
run.db that compaction thinned out, which must equal those of every step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from nanguard.record.report import load_report
from nanguard.record.spike_run import measure_run
from nanguard.record.spike_window import Window
from nanguard.record.spikes import SpikeMeter
from nanguard.record.store import RunStore, open_run


def ref_score(xs: list[float], window: int = 1000, min_window: int = 20, sigmas: float = 7.0,
              floor: float = 1e-6) -> tuple[int, int]:
    """(spikes, scored steps), straight from the definition: numpy mean/std of the previous
    finite values, no running sums."""
    hist: list[float] = []
    spikes = scored = 0
    for x in xs:
        if not math.isfinite(x):
            spikes += 1
            scored += 1
            continue
        if len(hist) >= min_window:
            w = np.array(hist[-window:])
            m, s = w.mean(), max(w.std(), floor * abs(w.mean()))
            spikes += bool(abs(x - m) > sigmas * s)
            scored += 1
        hist.append(x)
    return spikes, scored


def run_meter(loss: list[float], **more: list[float]) -> dict:
    meter = SpikeMeter()
    for i, x in enumerate(loss):
        meter.update(i, {"loss": x, **{k: v[i] for k, v in more.items()}})
    return meter.summary()


def noisy(n: int, seed: int = 0, level: float = 2.0, sd: float = 0.01) -> list[float]:
    return list(level + sd * np.random.default_rng(seed).standard_normal(n))


def test_window_matches_numpy_over_wraps_and_a_large_offset() -> None:
    rng = np.random.default_rng(1)
    xs = 1e4 + 1e-3 * rng.standard_normal(5000)  # large mean, tiny spread: no cancellation
    w = Window(1000)
    for i, x in enumerate(xs):
        w.push(float(x))
        if i % 397 == 0 or i == len(xs) - 1:
            ref = xs[max(0, i - 999):i + 1]
            mean, std = w.stats()
            assert mean == pytest.approx(ref.mean(), rel=1e-12)
            assert std == pytest.approx(ref.std(), rel=1e-6)
    assert w.values() == list(xs[-1000:])


def test_known_spikes_score_episodes_and_time_in_spike() -> None:
    loss = noisy(3000)
    loss[500:505] = [3.0, 2.6, 2.3, 2.15, 2.05]  # back within 10% of ~2.0 at step 503
    loss[1500] = 2.5  # one step
    loss[2500] = math.nan
    grad = noisy(3000, seed=2, level=1.0, sd=0.02)
    grad[498] = 3.0  # 2 steps before the first jump: ~3x its baseline
    s = run_meter(loss, grad_norm=grad)
    spikes, scored = ref_score(loss)
    assert s["steps_scored"]["loss"] == scored == 3000 - 20
    assert s["spike_steps"]["loss"] == spikes
    assert s["score"]["loss"] == pytest.approx(spikes / scored)
    g_spikes, g_scored = ref_score(grad)
    assert s["score"]["grad_norm"] == pytest.approx(g_spikes / g_scored) and g_spikes >= 1
    eps = s["episodes"]
    assert [(e["start"], e["peak_step"], e["recovered_at"], e["recovery_steps"]) for e in eps] == [
        (500, 500, 503, 3), (1500, 1500, 1501, 1), (2500, 2500, 2501, 1)]
    assert eps[0]["peak_value"] == 3.0 and eps[0]["baseline"] == pytest.approx(2.0, abs=0.01)
    assert math.isnan(eps[2]["peak_value"]) and not any(e["open"] for e in eps)
    assert s["episodes_total"] == 3 and s["steps_in_spike"] == 3 + 1 + 1
    assert s["time_in_spike"] == pytest.approx(5 / 3000)
    before = eps[0]["before"]["grad_norm"]
    assert before["steps_before"] == 2 and before["ratio"] == pytest.approx(3.0, rel=0.05)
    assert eps[0]["at_jump"]["grad_norm"] == pytest.approx(1.0, rel=0.1)


def test_fewer_steps_than_the_minimum_window_are_not_scored() -> None:
    loss = noisy(19)
    loss[10] = 100.0  # a jump, but before 20 values exist: not scored
    s = run_meter(loss)
    assert s["steps_scored"]["loss"] == 0 and s["score"]["loss"] is None
    assert s["episodes"] == [] and s["time_in_spike"] == 0.0 and s["steps"] == 19
    assert run_meter(noisy(21))["steps_scored"]["loss"] == 1  # the 21st step has 20 before it


def test_constant_series_has_no_spike_and_a_jump_after_it_is_one() -> None:
    s = run_meter([2.5] * 200)
    assert s["score"]["loss"] == 0.0 and s["episodes"] == []
    s = run_meter([2.5] * 200 + [2.6] + [2.5] * 10)
    assert s["spike_steps"]["loss"] == 1
    assert [(e["start"], e["recovered_at"]) for e in s["episodes"]] == [(200, 201)]


def test_nan_is_a_spike_and_stays_out_of_later_windows() -> None:
    loss = noisy(100)
    loss[50] = math.nan
    loss[60] = math.inf
    s = run_meter(loss)
    spikes, scored = ref_score(loss)
    assert (s["spike_steps"]["loss"], s["steps_scored"]["loss"]) == (spikes, scored)
    assert spikes == 2  # only the two non-finite values: the window after them is unharmed
    assert [(e["start"], e["recovered_at"]) for e in s["episodes"]] == [(50, 51), (60, 61)]
    # A non-finite loss before any finite one opens an episode that the first finite one ends.
    early = run_meter([math.nan, math.nan, *noisy(30)])
    assert early["steps_scored"]["loss"] == 2 + 30 - 20
    assert [(e["start"], e["recovered_at"], e["baseline"]) for e in early["episodes"]] == [
        (0, 2, None)]


def test_a_spike_the_run_ends_in_stays_open() -> None:
    loss = noisy(300) + [5.0, 4.0, 3.5, math.nan, 3.0]
    s = run_meter(loss)
    (ep,) = s["episodes"]
    assert ep["start"] == 300 and ep["open"] and ep["recovered_at"] is None
    assert ep["recovery_steps"] is None and ep["peak_step"] == 303  # non-finite is the peak
    assert s["steps_in_spike"] == 5 and s["time_in_spike"] == pytest.approx(5 / 305)


def test_state_round_trip_goes_on_exactly() -> None:
    loss = noisy(2500, seed=3)
    loss[700], loss[1200], loss[2400] = 4.0, math.nan, 5.0
    loss[2401:2404] = [4.0, 3.0, 2.1]
    whole = run_meter(loss)
    meter = SpikeMeter()
    for i, x in enumerate(loss[:1300]):
        meter.update(i, {"loss": x})
    again = SpikeMeter.from_state(json.loads(json.dumps(meter.state_dict())))
    for i, x in enumerate(loss[1300:], 1300):
        again.update(i, {"loss": x})
    assert json.dumps(again.summary()) == json.dumps(whole)


def test_measures_of_a_compacted_store_count_every_step(tmp_path: Path) -> None:
    loss = noisy(1500, seed=4)
    loss[300:303] = [3.0, 2.5, 2.0]
    loss[900] = math.nan
    loss[1450:1452] = [3.5, 3.0]  # in the full-resolution tail
    store = RunStore(tmp_path, keep_recent=100, bucket=100, window=5, flush_steps=50)
    for i, x in enumerate(loss):
        store.write_step({"step": i, "loss": x, "grad_norm": 1.0 + 0.01 * (i % 7),
                          "nonfinite": ["loss"] if math.isnan(x) else []})
    store.close()
    db = open_run(tmp_path)
    kept = db.execute("SELECT count(*) FROM steps").fetchone()[0]
    db.close()
    assert kept < 1000  # compaction did thin the store out (8 buckets per commit at most)
    got = measure_run(tmp_path)
    assert got is not None and got["complete"]
    assert json.dumps(got) == json.dumps(run_meter(loss, grad_norm=[
        1.0 + 0.01 * (i % 7) for i in range(1500)]))
    assert [e["start"] for e in got["episodes"]] == [300, 900, 1450]
    # The report rebuilt from run.db (no report.json: the process died) carries them too.
    assert json.dumps(load_report(tmp_path).spike_measures) == json.dumps(got)  # NaN peak


def test_merged_report_takes_the_part_most_in_spike_and_lists_every_part() -> None:
    from nanguard.record.merge import merge_reports
    from nanguard.record.report import Report

    calm = run_meter(noisy(100))
    loss = noisy(100)
    loss[80] = 9.0
    spiky = run_meter(loss)
    merged = merge_reports([("rank-0", Report(steps=100, spike_measures=calm)),
                            ("rank-1", Report(steps=100, spike_measures=spiky)),
                            ("rank-2", Report(steps=100))])
    m = merged.spike_measures
    assert m is not None and m["part"] == "rank-1" and m["episodes_total"] == 1
    assert set(m["parts"]) == {"rank-0", "rank-1"}
    assert m["parts"]["rank-0"]["time_in_spike"] == 0.0


def _write(store: RunStore, loss: list[float], first: int = 0) -> None:
    for i, x in enumerate(loss, first):
        store.write_step({"step": i, "loss": x, "nonfinite": ["loss"] if math.isnan(x) else []})


def test_a_resumed_store_goes_on_from_the_saved_meter(tmp_path: Path) -> None:
    loss = noisy(2000, seed=5)
    loss[400], loss[1700] = 3.0, 3.5
    store = RunStore(tmp_path, keep_recent=100, bucket=100, window=5, flush_steps=50)
    _write(store, loss[:900])
    store.close()
    store = RunStore(tmp_path, keep_recent=100, bucket=100, window=5, flush_steps=50)  # resume
    _write(store, loss[900:], 900)
    store.close()
    got = measure_run(tmp_path)
    assert got is not None and got["complete"]
    assert json.dumps(got) == json.dumps(run_meter(loss))


def test_a_store_compacted_without_a_meter_says_its_measures_are_partial(tmp_path: Path) -> None:
    store = RunStore(tmp_path, keep_recent=100, bucket=100, window=5, flush_steps=50)
    _write(store, noisy(1500, seed=6))
    store.close()
    db = open_run(tmp_path)
    with db:  # as a nanguard before the spike measures left it
        db.execute("DELETE FROM store_state WHERE key = 'spike_meter'")
    db.close()
    got = measure_run(tmp_path)
    assert got is not None and got["complete"] is False and "compacted" in got["note"]
    assert got["steps"] < 1500
