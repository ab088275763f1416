"""Compaction: the run store stays bounded on long runs.

Full resolution is kept for the last `keep_recent` steps and for `window` steps on each side of
every alarm, action and finding. Older steps are compacted after the writer's commits (on the
writer thread, or on the calling thread when the writer lags 16 batches behind; up to eight
buckets at a time, each in its own transaction, so a SIGKILL leaves a bucket either whole or
untouched) into buckets of `bucket` consecutive steps (aligned at multiples of `bucket`; a
bucket that contains kept steps is split around them). What a compacted bucket leaves:

- `steps`: the rows of REAL steps only, never made-up values: the bucket's last step, its first
  step with a non-finite value, and for every signal (loss, grad_norm, param_norm, ...) that
  varies in the bucket the step of its smallest and of its largest finite value. A reader of
  `steps` sees the kept rows; a plot's per-bucket min/max envelope over them is the true one.
  Typically 3-10 rows per bucket.
- `step_buckets(first, last, n, kept, nonfinite_steps, skipped, nonfinite, signals)`: one row
  per bucket: how many steps it had (`n`) and kept (`kept`), how many held a non-finite value
  (never averaged away) and which signals (`nonfinite`, a JSON list), how many updates were
  skipped, and `signals` = JSON {signal: [min, max, last, NaN count, inf count]} (min/max over
  finite values; `last` with NaN/inf as strings).
- `activations`: those of the kept steps. `param_blobs` / `param_stats` and `batches`: those of
  the last and the first non-finite step. `rng`: step 0's only (what `nanguard replay` needs;
  an alarm's RNG state is in its window, which is never compacted).
- `alarms`, `actions`, `findings`, `meta`, `params`: never compacted.
- `store_state` key `spike_meter`: every compacted step was fed to the spike measures first
  (`record/spike_run.py`); the meter's state is saved with the bucket, in its transaction.

The number of steps a run recorded is `step_count(db)` (`count(*)` of `steps` plus what the
buckets dropped).
"""

from __future__ import annotations

import json
import math
import sqlite3
from typing import Any

from nanguard.record.spike_run import feed, load_meter, save_meter
from nanguard.record.spikes import SIGNALS as SPIKE_SIGNALS
from nanguard.record.spikes import SpikeMeter

SIGNALS = ("loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm", "act_max", "lr",
           "amp_scale", "act_limit", "second_moment_norm", "attn_logit_max", "clip_norm")
"""`steps` columns summarised per bucket."""

_COLUMNS = ("step", *SIGNALS, "nonfinite", "skipped")


def _spike_value(row: Any, signal: str) -> Any:
    """A compacted row's value of a spike-meter signal: its grad norm is the norm before the
    script's own clipping where one was recorded (`clip_norm`), as `spike_run` reads it."""
    if signal == "grad_norm":
        clipped = row[1 + SIGNALS.index("clip_norm")]
        if clipped is not None:
            return clipped
    return row[1 + SIGNALS.index(signal)]


def step_count(db: sqlite3.Connection) -> int:
    """Steps recorded in a store: its `steps` rows plus the steps compaction removed."""
    n = int(db.execute("SELECT count(*) FROM steps").fetchone()[0])
    if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'step_buckets'").fetchone():
        n += int(db.execute("SELECT coalesce(sum(n - kept), 0) FROM step_buckets").fetchone()[0])
    return n


def _text(v: Any) -> Any:
    """A stored value as JSON can hold it (inf as a string; 'nan' already is one)."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


class Compactor:
    """Compacts the store's old steps; called by the writer thread under the store's lock.

    Args:
        db: the store's connection.
        keep_recent: steps at the end of the run kept at full resolution.
        bucket: steps per bucket.
        window: steps kept on each side of an alarm, action or finding.
        per_call: buckets compacted per call at most (bounds how long the lock is held; more
            than a full queue of steps, so compaction never falls behind for good).
    """

    def __init__(self, db: sqlite3.Connection, *, keep_recent: int, bucket: int, window: int,
                 per_call: int = 8) -> None:
        self.db = db
        self.keep_recent = keep_recent
        self.bucket = max(2, bucket)
        self.window = window
        self.per_call = per_call
        self.next: int | None = None
        """First step not yet considered (kept in `store_state`, so a resumed run goes on)."""
        self.meter: SpikeMeter | None = None
        """The spike measures of the steps compacted so far (None: a store compacted by an
        older version, whose measures cannot be complete)."""

    def __call__(self) -> None:
        last = self.db.execute("SELECT max(step) FROM steps").fetchone()[0]
        if last is None:
            return
        if self.next is None:
            row = self.db.execute("SELECT value FROM store_state WHERE key = 'compacted'"
                                  ).fetchone()
            first = self.db.execute("SELECT min(step) FROM steps").fetchone()[0]
            self.next = int(row[0]) if row else int(first)
            self.meter = load_meter(self.db)
        for _ in range(self.per_call):
            a = self.next
            b = (a // self.bucket + 1) * self.bucket - 1
            if b > last - self.keep_recent:
                return
            with self.db:
                self._range(a, b)
                self.db.execute("INSERT OR REPLACE INTO store_state VALUES ('compacted', ?)",
                                (b + 1,))
                if self.meter is not None:
                    save_meter(self.db, self.meter)
            self.next = b + 1

    def _range(self, a: int, b: int) -> None:
        """Compact the unprotected runs of steps `a..b`."""
        rows = self.db.execute(f"SELECT {', '.join(_COLUMNS)} FROM steps "
                               "WHERE step BETWEEN ? AND ? ORDER BY step", (a, b)).fetchall()
        if self.meter is not None:  # before any row goes: the spike score needs every step
            feed(self.meter, [(r[0], *(_spike_value(r, k) for k in SPIKE_SIGNALS))
                              for r in rows])
        if len(rows) < 2:
            return
        w = self.window
        events = [int(s) for (s,) in self.db.execute(
            "SELECT step FROM alarms WHERE step BETWEEN ?1 AND ?2 UNION "
            "SELECT step FROM actions WHERE step BETWEEN ?1 AND ?2 UNION "
            "SELECT json_extract(body, '$.step') FROM findings WHERE json_valid(body) AND "
            "json_extract(body, '$.step') BETWEEN ?1 AND ?2", (a - w, b + w)) if s is not None]
        run: list[tuple[Any, ...]] = []
        for r in rows:
            if any(abs(r[0] - e) <= w for e in events):
                self._bucket(run)
                run = []
            else:
                run.append(r)
        self._bucket(run)

    def _bucket(self, run: list[tuple[Any, ...]]) -> None:
        if len(run) < 2:
            return
        first, last = run[0][0], run[-1][0]
        kept = {last}
        bad = [r for r in run if r[-2] not in (None, "[]")]
        nonfinite: set[str] = set()
        for r in bad:
            nonfinite.update(json.loads(r[-2]))
        signals: dict[str, list[Any]] = {}
        for j, name in enumerate(SIGNALS, start=1):
            finite = [(r[j], r[0]) for r in run
                      if isinstance(r[j], int | float) and math.isfinite(r[j])]
            n_nan = sum(1 for r in run if r[j] == "nan")
            n_inf = sum(1 for r in run if isinstance(r[j], float) and math.isinf(r[j]))
            if not finite and not n_nan and not n_inf:
                continue  # never measured in this bucket
            lo = hi = None
            if finite:
                lo, hi = min(finite), max(finite)
                if not lo[0] == hi[0] == run[-1][j]:  # a constant is in the last row already
                    kept.update((lo[1], hi[1]))
            signals[name] = [lo[0] if lo else None, hi[0] if hi else None,
                             _text(run[-1][j]), n_nan, n_inf]
        first_bad = {r[0] for r in bad[:1]}
        self.db.execute(
            "INSERT OR REPLACE INTO step_buckets VALUES (?,?,?,?,?,?,?,?)",
            (first, last, len(run), len(kept | first_bad), len(bad),
             sum(int(r[-1] or 0) for r in run), json.dumps(sorted(nonfinite)),
             json.dumps(signals)))
        # Rows kept: `steps` and `activations` at the kept steps and the first non-finite one;
        # per-parameter values and the batch only at the last and the first non-finite step
        # (the steps around alarms keep theirs: they are never compacted); RNG states at step 0.
        self._delete(("steps", "activations"), first, last, kept | first_bad)
        self._delete(("param_blobs", "param_stats_rows", "batches"), first, last,
                     {last} | first_bad)
        self._delete(("rng",), first, last, {0})

    def _delete(self, tables: tuple[str, ...], first: int, last: int, keep: set[int]) -> None:
        marks = ",".join("?" * len(keep))
        for table in tables:
            self.db.execute(f"DELETE FROM {table} WHERE step BETWEEN ? AND ? "
                            f"AND step NOT IN ({marks})", (first, last, *sorted(keep)))
