"""Step series of a recorded run, read from run.db and downsampled into buckets for plotting.

A long run (1e6 steps, hundreds of layers) cannot go into a web page point by point. Every
series is cut into buckets of consecutive steps; a bucket keeps the minimum and maximum of its
finite values, its last value and how many of its values were non-finite (with the first such
step and value). A non-finite step is therefore never averaged away: it shows as a marker.
Full resolution stays in run.db.

The store is read through read-only connections (`file:...?mode=ro`), so a run that is still
training is never blocked: SQLite in WAL mode lets readers and one writer work concurrently.
"""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nanguard.record.store import DB_NAME, step_columns

STEP_COLUMNS = ("loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm", "act_max", "lr",
                "amp_scale", "second_moment_norm", "attn_logit_max")
"""Columns of the `steps` table read as series (`amp_scale` is absent from stores written
before it; such a store simply has no loss-scale series)."""

_FINITE = "(typeof({c}) IN ('real', 'integer') AND abs({c}) < 9e999)"
_NONFINITE = "(typeof({c}) = 'text' OR abs({c}) >= 9e999)"


@dataclass
class Buckets:
    """One series cut into buckets of consecutive steps.

    Attributes:
        step: first recorded step of each bucket.
        lo: smallest finite value per bucket (NaN where the bucket holds no finite value).
        hi: largest finite value per bucket (NaN where it holds none).
        last: the bucket's last value, as recorded (may be NaN or +-Inf).
        nonfinite: how many non-finite values the bucket holds.
        bad_step: first step with a non-finite value per bucket (-1 where none).
        bad_value: that value (NaN, +Inf or -Inf; 0 where none).
    """

    step: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    last: np.ndarray
    nonfinite: np.ndarray
    bad_step: np.ndarray
    bad_value: np.ndarray

    def __len__(self) -> int:
        return len(self.step)


def bucket_width(first: int, last: int, n_buckets: int) -> int:
    """Steps per bucket so that the steps `first..last` fit into at most `n_buckets` buckets."""
    span = max(0, last - first) + 1
    return max(1, math.ceil(span / max(1, n_buckets)))


def bucketize(steps: Any, values: Any, *, origin: int = 0, width: int = 1) -> Buckets:
    """Cut a series into buckets of `width` steps aligned at `origin`.

    Args:
        steps: recorded steps, ascending (missing steps are simply absent).
        values: the value at each step; NaN and +-Inf are kept and counted.
        origin: the step where bucket 0 starts (the same for every series of a page, so
            buckets line up across plots).
        width: steps per bucket (`bucket_width`).

    Returns:
        The buckets that hold at least one recorded step.
    """
    s = np.asarray(steps, dtype=np.int64)
    v = np.asarray(values, dtype=np.float64)
    if len(s) == 0:
        e = np.zeros(0)
        return Buckets(s, e, e, e, s.copy(), s.copy(), e)
    idx = (s - origin) // max(1, width)
    starts = np.flatnonzero(np.r_[True, idx[1:] != idx[:-1]])
    ends = np.r_[starts[1:], len(s)] - 1
    finite = np.isfinite(v)
    lo = np.minimum.reduceat(np.where(finite, v, np.inf), starts)
    hi = np.maximum.reduceat(np.where(finite, v, -np.inf), starts)
    none = ~np.isfinite(lo)
    lo[none] = np.nan
    hi[none] = np.nan
    bad = np.add.reduceat((~finite).astype(np.int64), starts)
    bad_pos = np.flatnonzero(~finite)
    bad_step = np.full(len(starts), -1, dtype=np.int64)
    bad_value = np.zeros(len(starts))
    if len(bad_pos):
        first = bad_pos[np.minimum(np.searchsorted(bad_pos, starts), len(bad_pos) - 1)]
        has = bad > 0
        bad_step[has] = s[first[has]]
        bad_value[has] = v[first[has]]
    return Buckets(s[starts], lo, hi, v[ends], bad, bad_step, bad_value)


@dataclass
class Heat:
    """Per-layer values (layers x buckets): the largest finite value per cell and the
    number of non-finite values in it."""

    layers: list[str]
    step: np.ndarray
    hi: np.ndarray
    nonfinite: np.ndarray
    bad_step: np.ndarray


@dataclass
class RunSeries:
    """Everything plotted for one run (or one part of a merged run)."""

    label: str
    folder: str
    first_step: int = 0
    last_step: int = -1
    steps: dict[str, Buckets] = field(default_factory=dict)
    grad_heat: Heat | None = None
    act_limit: float | None = None
    """The smallest activation dtype limit recorded (for the plot's title)."""
    activations: dict[str, Buckets] = field(default_factory=dict)
    state: dict[str, Buckets] = field(default_factory=dict)
    alarms: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    findings: list[dict[str, Any]] = field(default_factory=list)


def connect_ro(folder: str | Path) -> sqlite3.Connection:
    """A read-only connection to `folder/run.db` that never blocks a writer.

    Raises:
        ValueError: with a one-line message if there is no readable run store.
    """
    path = Path(folder)
    db_path = path / DB_NAME if path.is_dir() else path
    if not db_path.is_file():
        raise ValueError(f"{str(folder)!r} is not a nanguard run folder (no {DB_NAME} in it)")
    try:
        db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
        db.execute("SELECT count(*) FROM steps WHERE step < 0").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{str(db_path)!r} is not a readable nanguard run store ({exc})") from None
    return db


def step_range(folder: str | Path) -> tuple[int, int]:
    """First and last recorded step of a run (0, -1 when it has none)."""
    db = connect_ro(folder)
    try:
        lo, hi = db.execute("SELECT min(step), max(step) FROM steps").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{str(folder)!r}: cannot read its run store ({exc})") from None
    finally:
        db.close()
    return (0, -1) if lo is None else (int(lo), int(hi))


def _to_float(col: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Object column of SQLite values -> (present mask, float values of the present ones);
    'nan' text decodes to NaN, None means not recorded."""
    mask = np.array([v is not None for v in col], dtype=bool)
    return mask, col[mask].astype(np.float64)


def _headroom(
    limit: np.ndarray, act_max: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Decades left before the largest activation overflows its dtype, per step where both
    the dtype limit and the abs-max were recorded: log10(limit / abs-max), as
    `StepStats.act_headroom` (-inf once the abs-max is non-finite). Steps with an abs-max of
    0 (nothing to overflow) are left out. Returns (present mask, values, smallest limit), or
    None when no step has both."""
    lim = np.array([np.nan if v is None else float(v) for v in limit])
    top = np.array([np.nan if v is None else float(v) for v in act_max])
    recorded = np.array([v is not None for v in act_max], dtype=bool)
    mask = np.isfinite(lim) & (lim > 0) & recorded & (top != 0)
    if not mask.any():
        return None
    lim, top = lim[mask], np.abs(top[mask])
    with np.errstate(divide="ignore", invalid="ignore"):
        head = np.log10(lim) - np.log10(top)
    head = np.where(np.isfinite(top), head, -np.inf)
    return mask, head, float(lim.min())


def _heat(db: sqlite3.Connection, origin: int, width: int) -> Heat | None:
    """Per-layer grad norm per bucket from `param_stats` (aggregated inside SQLite)."""
    names = dict(db.execute("SELECT id, name FROM params").fetchall())
    fin, bad = _FINITE.format(c="grad_norm"), _NONFINITE.format(c="grad_norm")
    rows = db.execute(
        f"SELECT param_id, (step - ?) / ? AS b, min(step), "
        f"max(CASE WHEN {fin} THEN grad_norm END), "
        f"sum(CASE WHEN {bad} THEN 1 ELSE 0 END), min(CASE WHEN {bad} THEN step END) "
        "FROM param_stats GROUP BY b, param_id",
        (origin, width),
    ).fetchall()
    if not rows:
        return None
    arr = np.array(rows, dtype=object)
    pids = sorted({int(p) for p in arr[:, 0]})
    row_of = {p: i for i, p in enumerate(pids)}
    buckets = np.array(sorted({int(b) for b in arr[:, 1]}), dtype=np.int64)
    col_of = {int(b): j for j, b in enumerate(buckets)}
    shape = (len(pids), len(buckets))
    hi = np.full(shape, np.nan)
    nonfinite = np.zeros(shape, dtype=np.int64)
    bad_step = np.full(shape, -1, dtype=np.int64)
    first_step = np.full(len(buckets), np.iinfo(np.int64).max, dtype=np.int64)
    for pid, b, s0, h, n, bs in rows:
        i, j = row_of[int(pid)], col_of[int(b)]
        if h is not None:
            hi[i, j] = float(h)
        nonfinite[i, j] = int(n or 0)
        if bs is not None:
            bad_step[i, j] = int(bs)
        first_step[j] = min(first_step[j], int(s0))
    layers = [str(names.get(p, f"param {p}")) for p in pids]
    return Heat(layers, first_step, hi, nonfinite, bad_step)


def _grouped(
    db: sqlite3.Connection, sql: str, origin: int, width: int
) -> dict[str, Buckets]:
    """Series keyed by name from `sql` yielding (name, step, value) ordered by name, step."""
    rows = db.execute(sql).fetchall()
    out: dict[str, Buckets] = {}
    if not rows:
        return out
    arr = np.array(rows, dtype=object)
    names = arr[:, 0]
    cut = np.flatnonzero(np.r_[True, names[1:] != names[:-1], True])
    for a, b in zip(cut[:-1], cut[1:], strict=True):
        mask, vals = _to_float(arr[a:b, 2])
        steps = arr[a:b, 1][mask].astype(np.int64)
        out[str(names[a])] = bucketize(steps, vals, origin=origin, width=width)
    return out


def load_series(
    folder: str | Path,
    label: str,
    *,
    origin: int = 0,
    width: int = 1,
    heat_width: int | None = None,
    max_modules: int = 8,
) -> RunSeries:
    """Read one run store into bucketed series.

    Args:
        folder: a folder holding run.db.
        label: the name its traces carry (the run, or run/part).
        origin: first step of bucket 0 (shared by all runs of a page).
        width: steps per bucket.
        heat_width: steps per bucket of the per-layer heat map (default `width`).
        max_modules: activation series kept: the modules with the most non-finite values,
            then the largest abs-max.

    Raises:
        ValueError: one line, if run.db is missing or unreadable.
    """
    db = connect_ro(folder)
    out = RunSeries(label=label, folder=str(folder))
    try:
        have = step_columns(db)
        cols = [c for c in STEP_COLUMNS if c in have]
        limit_col = "act_limit" if "act_limit" in have else "NULL"
        rows = db.execute(
            f"SELECT step, {limit_col}, {', '.join(cols)} FROM steps ORDER BY step"
        ).fetchall()
        if rows:
            arr = np.array(rows, dtype=object)
            steps = arr[:, 0].astype(np.int64)
            out.first_step, out.last_step = int(steps[0]), int(steps[-1])
            for j, name in enumerate(cols, 2):
                mask, vals = _to_float(arr[:, j])
                if mask.any():
                    out.steps[name] = bucketize(steps[mask], vals, origin=origin, width=width)
            if "act_max" in cols:
                head = _headroom(arr[:, 1], arr[:, 2 + cols.index("act_max")])
                if head is not None:
                    mask, vals, out.act_limit = head
                    out.steps["act_headroom"] = bucketize(steps[mask], vals, origin=origin,
                                                          width=width)
        out.grad_heat = _heat(db, origin, heat_width or width)
        acts = _grouped(
            db, "SELECT module, step, absmax FROM activations ORDER BY module, step", origin, width
        )
        ranked = sorted(
            acts.items(),
            key=lambda kv: (-int(kv[1].nonfinite.sum()), -float(np.nanmax(kv[1].hi, initial=0))),
        )
        out.activations = dict(ranked[:max_modules])
        out.state = _state_norms(db, origin, width)
        out.alarms = [
            {"step": s, "kind": k, "signal": g, "message": m}
            for s, k, g, m in db.execute(
                "SELECT step, kind, signal, message FROM alarms ORDER BY step, rowid"
            )
        ]
        out.actions = [
            {"step": s, "action": a, "detail": d}
            for s, a, d in db.execute("SELECT step, action, detail FROM actions ORDER BY step")
        ]
        for (body,) in db.execute("SELECT body FROM findings ORDER BY id"):
            try:
                out.findings.append(json.loads(body))
            except (TypeError, ValueError):
                continue
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{str(folder)!r}: cannot read its run store ({exc})") from None
    finally:
        db.close()
    return out


def _state_norms(db: sqlite3.Connection, origin: int, width: int) -> dict[str, Buckets]:
    """Global norm per optimizer-state kind (momentum_buffer, exp_avg, exp_avg_sq) per step:
    the root of the sum of squares of the per-parameter norms in `param_stats.state`."""
    fin = "(j.type IN ('real', 'integer') AND abs(j.value) < 9e999)"
    rows = db.execute(
        "SELECT j.key, p.step, "
        f"sum(CASE WHEN {fin} THEN j.value * j.value ELSE 0 END), "
        f"sum(CASE WHEN {fin} THEN 0 ELSE 1 END), "
        "max(CASE WHEN j.type = 'text' AND j.value != 'nan' THEN "
        "(CASE WHEN j.value LIKE '-%' THEN -1 ELSE 1 END) ELSE 0 END) "
        "FROM param_stats p, json_each(p.state) j WHERE json_valid(p.state) "
        "GROUP BY j.key, p.step ORDER BY j.key, p.step"
    ).fetchall()
    out: dict[str, Buckets] = {}
    if not rows:
        return out
    arr = np.array(rows, dtype=object)
    keys = arr[:, 0]
    cut = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1], True])
    for a, b in zip(cut[:-1], cut[1:], strict=True):
        steps = arr[a:b, 1].astype(np.int64)
        norm = np.sqrt(arr[a:b, 2].astype(np.float64))
        bad = arr[a:b, 3].astype(np.int64) > 0
        sign = arr[a:b, 4].astype(np.float64)
        # A non-finite member makes the norm non-finite: inf if one was inf, else NaN.
        norm[bad] = np.where(sign[bad] != 0, np.inf, np.nan)
        out[str(keys[a])] = bucketize(steps, norm, origin=origin, width=width)
    return out
