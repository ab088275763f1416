"""The run store: one SQLite database per run folder, written as the run goes.

Crash safety: WAL journal, one transaction per recorded step. A process killed with SIGKILL
loses at most the step it was writing; the database opens and holds every completed step.
NaN is not representable in SQLite (it is stored as NULL), so NaN is encoded as the text 'nan'
and decoded back (infinities are stored as REAL): the record never drops a NaN point.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = """
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

DB_NAME = "run.db"

STEP_ROW = ("step", "time", "loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm",
            "act_max", "lr", "nonfinite", "skipped", "amp_scale", "act_limit")
"""Columns of the `steps` table. `amp_scale` (the GradScaler's loss scale) and `act_limit`
(largest finite value of the activations' narrowest dtype, for the headroom) came later: a
store written before them lacks them (`add_missing_columns` adds them when it is reopened for
writing; readers check `step_columns`)."""
_LATER_STEP_COLUMNS = ("amp_scale", "act_limit")


def step_columns(db: sqlite3.Connection) -> set[str]:
    """The columns the `steps` table of this store has (older stores lack the later ones)."""
    return {str(r[1]) for r in db.execute("PRAGMA table_info(steps)")}


def add_missing_columns(db: sqlite3.Connection) -> None:
    """Add the `steps` columns a store written by an older version lacks (NULL for its rows)."""
    have = step_columns(db)
    for col in _LATER_STEP_COLUMNS:
        if col not in have:
            db.execute(f"ALTER TABLE steps ADD COLUMN {col}")


def enc(x: float | None) -> float | str | None:
    """Encode a float for SQLite without losing NaN."""
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    return x


def dec(x: Any) -> float | None:
    """Decode what `enc` stored."""
    if x is None:
        return None
    return float(x)


class NullStore:
    """Records nothing: used when recording is off, so callers never test `if store:`."""

    path: Path | None = None

    def write_meta(self, **values: Any) -> None: ...
    def write_params(self, names: list[tuple[str, tuple[int, ...], int]]) -> None: ...
    def write_step(
        self,
        row: dict[str, Any],
        *,
        params: Sequence[tuple[int, float | None, float | None, dict[str, float]]] = (),
        activations: dict[str, float] | None = None,
        batch: tuple[str, list[int], list[int]] | None = None,
        alarms: Sequence[dict[str, Any]] = (),
    ) -> None: ...
    def write_alarm(self, alarm: dict[str, Any]) -> None: ...
    def write_action(self, step: int, action: str, detail: str) -> None: ...
    def write_rng(self, step: int, state: bytes) -> None: ...
    def write_finding(self, body: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class RunStore(NullStore):
    """Writes one run's record into `folder/run.db`.

    Args:
        folder: the run folder; created if missing. Raises ValueError if it cannot be written.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / ".nanguard_write_test"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ValueError(
                f"cannot write the run folder {str(self.folder)!r} ({exc.strerror or exc}); "
                "pass a writable run folder (Guard(out=...) / --out DIR), or out='' to "
                "record nothing"
            ) from None
        self.path = self.folder / DB_NAME
        self.db = sqlite3.connect(self.path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode survives a process crash (SIGKILL); only power loss may drop the
        # last transaction, and the database still opens.
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        add_missing_columns(self.db)
        self.db.commit()

    def write_meta(self, **values: Any) -> None:
        with self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [(k, json.dumps(v)) for k, v in values.items()],
            )

    def write_params(self, names: list[tuple[str, tuple[int, ...], int]]) -> None:
        with self.db:
            self.db.executemany(
                "INSERT OR REPLACE INTO params VALUES (?, ?, ?, ?)",
                [(i, n, json.dumps(list(s)), k) for i, (n, s, k) in enumerate(names)],
            )

    def write_step(
        self,
        row: dict[str, Any],
        *,
        params: Sequence[tuple[int, float | None, float | None, dict[str, float]]] = (),
        activations: dict[str, float] | None = None,
        batch: tuple[str, list[int], list[int]] | None = None,
        alarms: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Write everything about one step in a single transaction."""
        step = row["step"]
        with self.db:
            self.db.execute(
                f"INSERT OR REPLACE INTO steps ({', '.join(STEP_ROW)}) "
                f"VALUES ({', '.join('?' * len(STEP_ROW))})",
                (
                    step,
                    time.time(),
                    enc(row.get("loss")),
                    enc(row.get("grad_norm")),
                    enc(row.get("param_norm")),
                    enc(row.get("update_ratio")),
                    enc(row.get("momentum_norm")),
                    enc(row.get("act_max")),
                    enc(row.get("lr")),
                    json.dumps(row.get("nonfinite", [])),
                    int(row.get("skipped", False)),
                    enc(row.get("amp_scale")),
                    enc(row.get("act_limit")),
                ),
            )
            if params:
                self.db.executemany(
                    "INSERT OR REPLACE INTO param_stats VALUES (?,?,?,?,?)",
                    [
                        (step, pid, enc(g), enc(p), json.dumps({k: _jf(v) for k, v in s.items()}))
                        for pid, g, p, s in params
                    ],
                )
            if activations:
                self.db.executemany(
                    "INSERT OR REPLACE INTO activations VALUES (?,?,?)",
                    [(step, m, enc(v)) for m, v in activations.items()],
                )
            if batch is not None:
                fp, samples, bad = batch
                self.db.execute(
                    "INSERT OR REPLACE INTO batches VALUES (?,?,?,?)",
                    (step, fp, json.dumps(samples), json.dumps(bad)),
                )
            for a in alarms:
                self._insert_alarm(a)

    def _insert_alarm(self, a: dict[str, Any]) -> None:
        self.db.execute(
            "INSERT INTO alarms VALUES (?,?,?,?,?)",
            (a["step"], a["kind"], a["signal"], enc(a["value"]), a["message"]),
        )

    def write_alarm(self, alarm: dict[str, Any]) -> None:
        with self.db:
            self._insert_alarm(alarm)

    def write_action(self, step: int, action: str, detail: str) -> None:
        with self.db:
            self.db.execute("INSERT INTO actions VALUES (?,?,?)", (step, action, detail))

    def write_rng(self, step: int, state: bytes) -> None:
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO rng VALUES (?,?)", (step, state))

    def write_finding(self, body: dict[str, Any]) -> None:
        with self.db:
            self.db.execute("INSERT INTO findings (body) VALUES (?)", (json.dumps(body),))

    def close(self) -> None:
        self.db.close()


def _jf(v: float) -> float | str:
    """JSON has no NaN/Inf: store them as strings."""
    return v if math.isfinite(v) else str(v)


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
