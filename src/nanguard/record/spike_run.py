"""report.json's `spike_measures` of a recorded run, read from its run.db.

Why from the store and not from the guard's step hooks: the training thread pays nothing, and
the same code serves a closing guard, a run rebuilt from run.db after a SIGKILL, and
`nanguard report` of a run recorded before the measures existed.

Why a saved meter state: compaction (`record/compact.py`) thins out steps older than the last
1000, and the spike score needs every step. The compactor therefore feeds each step it is about
to compact to a `SpikeMeter` and saves the meter's state (`store_state` key `spike_meter`) in
the same transaction; `measure_db` goes on from that state with the steps after it, all still
at full resolution. A store compacted before that existed has no state: its measures cover the
steps left and say so (`complete: false`, `note`).
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanguard.record.files import DB_NAME
from nanguard.record.spikes import SIGNALS, SpikeMeter

STATE_KEY = "spike_meter"
"""The `store_state` key of the compactor's saved meter."""


def feed(meter: SpikeMeter, rows: Sequence[Sequence[Any]]) -> None:
    """Feed rows of (step, *SIGNALS) as stored (NaN as the text 'nan') to `meter`."""
    for row in rows:
        meter.update(int(row[0]), {k: None if v is None else float(v)
                                   for k, v in zip(SIGNALS, row[1:], strict=True)})


def load_meter(db: sqlite3.Connection) -> SpikeMeter | None:
    """The compactor's saved meter; a fresh one for a store never compacted; None for a store
    compacted without one (an older version's)."""
    row = db.execute("SELECT value FROM store_state WHERE key = ?", (STATE_KEY,)).fetchone()
    if row is not None:
        return SpikeMeter.from_state(json.loads(row[0]))
    done = db.execute("SELECT 1 FROM store_state WHERE key = 'compacted'").fetchone()
    return None if done else SpikeMeter()


def save_meter(db: sqlite3.Connection, meter: SpikeMeter) -> None:
    """Save the meter's state (inside the caller's transaction)."""
    db.execute("INSERT OR REPLACE INTO store_state VALUES (?, ?)",
               (STATE_KEY, json.dumps(meter.state_dict())))


def measure_db(db: sqlite3.Connection) -> dict[str, Any]:
    """The spike measures of the store `db`, read in one transaction (a compaction committed
    by a writer meanwhile is seen entirely or not at all)."""
    have = {str(r[1]) for r in db.execute("PRAGMA table_info(steps)")}
    # The grad norm before the script's own clipping where one was recorded (`clip_norm`):
    # OLMo's grad-norm score is of that norm, not of the clipped one the optimizer used.
    pick = {"grad_norm": "COALESCE(clip_norm, grad_norm)"} if "clip_norm" in have else {}
    cols = ", ".join(pick.get(c, c) if c in have else "NULL" for c in SIGNALS)
    in_tx = db.in_transaction
    if not in_tx:
        db.execute("BEGIN")
    try:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master")}
        meter = load_meter(db) if "store_state" in tables else SpikeMeter()
        partial = meter is None
        meter = meter or SpikeMeter()
        rows = db.execute(f"SELECT step, {cols} FROM steps WHERE step > ? ORDER BY step",
                          (meter.last_step,)).fetchall()
    finally:
        if not in_tx:
            db.rollback()
    feed(meter, rows)
    out = meter.summary()
    if partial:
        out["complete"] = False
        out["note"] = ("this run.db was compacted by a nanguard without spike measures: they "
                       "cover the steps it kept, not every step")
    return out


def measure_run(folder: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The spike measures of the run recorded in `folder`; None without a readable run.db
    (nothing recorded, `out=""`). Never raises: an unreadable store gives `{error}`."""
    if folder is None or not (Path(folder) / DB_NAME).is_file():
        return None
    try:
        db = sqlite3.connect(Path(folder) / DB_NAME)
        try:
            return measure_db(db)
        finally:
            db.close()
    except Exception as exc:  # noqa: BLE001 - measures are an extra: the report is still written
        return {"error": f"{type(exc).__name__}: {exc}"}


def merge_measures(parts: Sequence[tuple[str, dict[str, Any] | None]]) -> dict[str, Any] | None:
    """The spike measures of the part that spent the most time in spike (the first such part
    on a tie), labelled `part`, and each part's headline numbers under `parts`: the loss of
    every rank (or optimizer) is its own series, so the parts are never pooled."""
    have = [(label, m) for label, m in parts if m and "score" in m]
    if not have:
        return None
    label, worst = max(have, key=lambda p: p[1].get("time_in_spike") or 0.0)
    return {**worst, "part": label, "parts": {
        lb: {k: m.get(k) for k in ("score", "episodes_total", "time_in_spike", "complete")}
        for lb, m in have}}
