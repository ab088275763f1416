"""The run store's schema: its tables, how an older store is brought up to date, and how a
recorded run is opened for reading (`open_run`).

`RunStore` (`record.store`) creates and writes these tables; every reader (the report, the CLI,
the dashboard, the exporters) opens a run with `open_run` and checks `step_columns` for the
columns a store written by an older version lacks.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

from nanguard.record import files

__all__ = ["DB_NAME", "SCHEMA", "add_missing_columns", "dec", "open_run", "prepare",
           "step_columns"]

_BLOBS = """SELECT b.step, CAST(j.key AS INTEGER), json_extract(j.value, '$[0]'),
        json_extract(j.value, '$[1]'), json_extract(j.value, '$[2]')
    FROM param_blobs b, json_each(b.rows) j"""
_VIEW = "CREATE VIEW param_stats (step, param_id, grad_norm, param_norm, state) AS "

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS params (id INTEGER PRIMARY KEY, name TEXT, shape TEXT, numel INTEGER);
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY, time REAL, loss, grad_norm, param_norm, update_ratio,
    momentum_norm, act_max, lr, nonfinite TEXT, skipped INTEGER, amp_scale, act_limit,
    second_moment_norm, attn_logit_max, clip_norm);
CREATE TABLE IF NOT EXISTS param_stats_rows (
    step INTEGER, param_id INTEGER, grad_norm, param_norm, state TEXT,
    PRIMARY KEY (step, param_id));
CREATE TABLE IF NOT EXISTS param_blobs (step INTEGER PRIMARY KEY, rows TEXT);
CREATE TABLE IF NOT EXISTS activations (step INTEGER, module TEXT, absmax,
    PRIMARY KEY (step, module));
CREATE TABLE IF NOT EXISTS batches (step INTEGER PRIMARY KEY, fingerprint TEXT, samples TEXT,
    nonfinite_samples TEXT);
CREATE TABLE IF NOT EXISTS rng (step INTEGER PRIMARY KEY, state BLOB);
CREATE TABLE IF NOT EXISTS alarms (step INTEGER, kind TEXT, signal TEXT, value, message TEXT);
CREATE INDEX IF NOT EXISTS alarms_step ON alarms (step);
CREATE TABLE IF NOT EXISTS actions (step INTEGER, action TEXT, detail TEXT);
CREATE INDEX IF NOT EXISTS actions_step ON actions (step);
CREATE TABLE IF NOT EXISTS findings (id INTEGER PRIMARY KEY, body TEXT);
CREATE TABLE IF NOT EXISTS step_buckets (first INTEGER PRIMARY KEY, last INTEGER, n INTEGER,
    kept INTEGER, nonfinite_steps INTEGER, skipped INTEGER, nonfinite TEXT, signals TEXT);
CREATE TABLE IF NOT EXISTS store_state (key TEXT PRIMARY KEY, value);
CREATE VIEW IF NOT EXISTS param_stats (step, param_id, grad_norm, param_norm, state) AS
    SELECT step, param_id, grad_norm, param_norm, state FROM param_stats_rows
    UNION ALL {BLOBS};
CREATE TRIGGER IF NOT EXISTS param_stats_insert INSTEAD OF INSERT ON param_stats BEGIN
    INSERT OR REPLACE INTO param_stats_rows
    VALUES (NEW.step, NEW.param_id, NEW.grad_norm, NEW.param_norm, NEW.state);
END;
""".replace("{BLOBS}", _BLOBS)
"""The store's tables. `param_stats` is a view of both forms of per-parameter rows (INSERTs into it
land in `param_stats_rows`); `RunStore` makes a new store's view read `param_blobs` only (faster:
SQLite cannot flatten a UNION ALL view under GROUP BY)."""

DB_NAME = files.DB_NAME

_LATER_STEP_COLUMNS = ("amp_scale", "act_limit", "second_moment_norm", "attn_logit_max",
                       "clip_norm")
"""`steps` columns that came later: a store written before them lacks them (`add_missing_columns`
adds them when it is reopened for writing; readers check `step_columns`)."""


def step_columns(db: sqlite3.Connection) -> set[str]:
    """The columns the `steps` table of this store has (older stores lack the later ones)."""
    return {str(r[1]) for r in db.execute("PRAGMA table_info(steps)")}


def add_missing_columns(db: sqlite3.Connection) -> None:
    """Add the `steps` columns a store written by an older version lacks (NULL for its rows)."""
    have = step_columns(db)
    for col in _LATER_STEP_COLUMNS:
        if col not in have:
            db.execute(f"ALTER TABLE steps ADD COLUMN {col}")


def _upgrade(db: sqlite3.Connection) -> None:
    """A store written before `param_blobs` has a real `param_stats` table: it becomes
    `param_stats_rows`, read through the view like before."""
    kind = db.execute("SELECT type FROM sqlite_master WHERE name = 'param_stats'").fetchone()
    if kind and kind[0] == "table":
        db.execute("ALTER TABLE param_stats RENAME TO param_stats_rows")


def _blob_view(db: sqlite3.Connection) -> None:
    """A store without one-row-per-parameter rows reads `param_stats` from `param_blobs` only."""
    if db.execute("SELECT 1 FROM param_stats_rows LIMIT 1").fetchone() is None:
        db.execute("DROP VIEW param_stats")  # and its INSERT trigger
        db.execute(_VIEW + _BLOBS)


def prepare(db: sqlite3.Connection) -> None:
    """Make `db` a current store: an older one upgraded, the tables that are missing created,
    the later `steps` columns added, `param_stats` read from `param_blobs` alone where it can."""
    _upgrade(db)
    db.executescript(SCHEMA)
    add_missing_columns(db)
    _blob_view(db)


def dec(x: Any) -> float | None:
    """Decode what `enc` stored."""
    if x is None:
        return None
    return float(x)


def open_run(folder: str | os.PathLike[str]) -> sqlite3.Connection:
    """Open a recorded run. Raises ValueError with a one-line message if it is not one."""
    path = Path(folder)
    db_path = path / DB_NAME if path.is_dir() else path
    if not db_path.exists():
        raise ValueError(f"{str(folder)!r} is not a nanguard run folder (no {DB_NAME} in it)")
    try:
        # Not read-only: opening a store left by a killed process replays its WAL.
        db = sqlite3.connect(db_path)
        db.execute("SELECT count(*) FROM steps").fetchone()
    except sqlite3.DatabaseError as exc:
        raise ValueError(f"{str(db_path)!r} is not a readable nanguard run store ({exc})") from None
    return db
