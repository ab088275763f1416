"""The run store: one SQLite database per run folder (`run.db`, WAL journal), written as the run
goes, off the training thread.

What the training thread pays: `write_step` queues the step's values (plain Python data, no
JSON, no SQL); a writer thread (`record/writer.py`) encodes and writes them in batched
transactions of at most `flush_steps` (256) items. It wakes every `flush_seconds` (0.5 s), or as
soon as 256 items (or 32768 per-parameter values) wait. The queue is bounded: past 16 times
that, the calling thread writes it itself. Alarms, actions and findings are written AND
committed on the calling thread before the call returns, after everything queued before them;
so is a step that carries an alarm, a skip or a non-finite value new to the run (not the same
signals as the step before), and the next step recorded after any alarm, action or finding.

Crash-safety promise (tested by SIGKILL at random points, tests/test_crash_safe.py): a process
killed at any point leaves a store that opens (`open_run`) and holds
  - every step up to the last commit, with no gap: what is lost is the steps queued since, at
    most those of the last `flush_seconds` before the kill while the writer thread gets the
    CPU, and never more than 16 x `flush_steps` items;
  - every alarm, action and finding whose `write_*` call returned, and every step that
    triggered one (a step recorded with an alarm, a skip, or non-finite signals other than the
    step before's is committed before `write_step` returns; an action or finding written
    before its step is recorded is followed by that step's commit). Steps that stay
    non-finite in the same signals after that first one are queued like plain steps (a run
    NaN at every step must not pay a commit per step);
  - no half-written step: one transaction holds a step's row, its per-parameter values, its
    activations, its batch and its alarms.
The WAL with synchronous=NORMAL survives a process crash; only a power loss may drop the last
transactions, and the database still opens.

The tables, how an older store is brought up to date and how a recorded run is opened for
reading are in `record.schema` (its names are importable from here too). Schema notes: NaN
is stored as the text 'nan' (SQLite turns a NaN REAL into NULL), infinities
as REAL. A step's per-parameter values are ONE row of `param_blobs` (`writer.param_blob`: one
JSON array per parameter, 9 significant digits). `param_stats(step, param_id, grad_norm,
param_norm, state)` is a VIEW that reads them one row per parameter (SQLite's json_each), with
the same values and types as the table of one row per parameter that older versions wrote; a
store that holds such rows (reopening an old store renames its table `param_stats_rows`) reads
both through it. Long runs are compacted (`record/compact.py`): see there for what a reader of
`steps` sees, and `step_count` for the number of steps recorded.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanguard.record.compact import Compactor, step_count
from nanguard.record.process import identity
from nanguard.record.schema import (
    DB_NAME,
    SCHEMA,
    add_missing_columns,
    dec,
    open_run,
    prepare,
    step_columns,
)
from nanguard.record.writer import (
    STEP_ROW,
    WAKE_WEIGHT,
    PerParam,
    RawHashes,
    StoreError,
    Writer,
    enc,
    from_rows,
)

__all__ = ["DB_NAME", "SCHEMA", "STEP_ROW", "NullStore", "RunStore", "StoreError",
           "add_missing_columns", "dec", "enc", "open_run", "step_columns", "step_count"]

class NullStore:
    """Records nothing: used when recording is off, so callers never test `if store:`."""

    path: Path | None = None
    folder: Path | None = None
    """The run folder (None: nothing is recorded)."""
    error: BaseException | None = None

    def write_meta(self, **values: Any) -> None: ...
    def write_params(self, names: list[tuple[str, tuple[int, ...], int]]) -> None: ...
    def write_step(
        self,
        row: dict[str, Any],
        *,
        params: Sequence[tuple[int, float | None, float | None, dict[str, float]]] = (),
        per_param: PerParam | None = None,
        activations: dict[str, float] | None = None,
        batch: tuple[str | None, list[int] | RawHashes, list[int]] | None = None,
        alarms: Sequence[dict[str, Any]] = (),
    ) -> None: ...
    def write_alarm(self, alarm: dict[str, Any]) -> None: ...
    def write_action(self, step: int, action: str, detail: str) -> None: ...
    def write_rng(self, step: int, state: bytes) -> None: ...
    def write_finding(self, body: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class RunStore(NullStore):
    """Writes one run's record into `folder/run.db` (see the module docstring for when what is
    committed).

    Errors: a failure of the background writer never raises on its thread; it is kept in
    `error`, writing stops, and the next `write_*` or `flush()` call raises `StoreError` on the
    calling thread (the Guard's fail-open path then stands nanguard down, status degraded).
    `close()` never raises: it prints one line to stderr if the store had failed.

    Args:
        folder: the run folder; created if missing. Raises ValueError if it cannot be written.
        flush_steps: commit once this many items are queued...
        flush_seconds: ...or this long after the last commit, whichever comes first.
        keep_recent: compaction leaves the last `keep_recent` steps at full resolution
            (negative: never compact).
        bucket: steps per compacted bucket.
        window: steps kept at full resolution on each side of an alarm, action or finding.
    """

    FLUSH_STEPS = 256
    FLUSH_SECONDS = 0.5
    """The defaults of `flush_steps` / `flush_seconds` (the crash-safety promise's bounds)."""

    def __init__(self, folder: str | os.PathLike[str], *, flush_steps: int = FLUSH_STEPS,
                 flush_seconds: float = FLUSH_SECONDS, keep_recent: int = 1000,
                 bucket: int = 1000, window: int = 50) -> None:
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
        # last transactions, and the database still opens.
        self.db.execute("PRAGMA synchronous=NORMAL")
        # After a checkpoint the WAL file is cut back to this size (a long run's WAL stays small).
        self.db.execute("PRAGMA journal_size_limit=8388608")
        prepare(self.db)
        self.db.commit()
        compactor = Compactor(self.db, keep_recent=keep_recent, bucket=bucket, window=window)
        self._writer = Writer(self.db, flush_steps=flush_steps, flush_seconds=flush_seconds,
                              after_commit=compactor if keep_recent >= 0 else None)
        self._sync_next = False
        self._last_nonfinite: list[str] | None = None
        """The non-finite signals of the last step recorded (a repeat is not committed at once)."""
        # Runs at close(), when the store is garbage-collected, or at interpreter exit: a run
        # that never closes still writes its last steps, and a dropped store ends its thread.
        self._finalizer = weakref.finalize(self, _shut, self._writer, self.db)
        # Who writes it: a reader tells a run still training (`running`) from one that died.
        self.write_meta(process=identity())

    @property
    def error(self) -> BaseException | None:  # type: ignore[override]
        """The first error the store hit while writing (None while it writes)."""
        return self._writer.error

    def write_meta(self, **values: Any) -> None:
        """Write run metadata and commit before returning."""
        self._writer.write_now(("meta", values))

    def write_params(self, names: list[tuple[str, tuple[int, ...], int]]) -> None:
        """Write the parameter table (name, shape, numel by index) and commit before returning."""
        self._writer.write_now(("params", names))

    def write_step(
        self,
        row: dict[str, Any],
        *,
        params: Sequence[tuple[int, float | None, float | None, dict[str, float]]] = (),
        per_param: PerParam | None = None,
        activations: dict[str, float] | None = None,
        batch: tuple[str | None, list[int] | RawHashes, list[int]] | None = None,
        alarms: Sequence[dict[str, Any]] = (),
    ) -> None:
        """Record one step; its row, per-parameter values, activations, batch and alarms are
        written in one transaction.

        Queued for the writer thread, except a step with alarms, a non-finite value or a skip,
        and the first step recorded after an alarm, action or finding: those are written and
        committed before this returns. The caller must not change the containers it passes
        afterwards (the writer reads them later); `rows.write_step` passes copies.

        Args:
            row: the `steps` columns (`step` required; missing ones are NULL).
            params: older form of `per_param`: one (index, grad norm, param norm, state norms)
                per parameter.
            per_param: (n, grad norms, param norms, {state key: norms}), by parameter index.
            activations: module name -> activation abs-max.
            batch: (fingerprint or None to compute it, per-sample fingerprints (or the
                per-tensor sums they are combined from, `fingerprint.RawHashes`: the writer
                thread combines them), indices of the non-finite samples).
            alarms: the step's alarms (`Alarm.to_dict()`).
        """
        item = ("step", row, time.time(), per_param if per_param is not None or not params
                else from_rows(params), activations, batch, alarms)
        # A non-finite step is committed at once when its non-finite signals are new (the step
        # before held other ones, or none): a run that stays NaN step after step (`observe`)
        # must not pay a commit per step, and its first such step is already on disk.
        nonfinite = row.get("nonfinite") or None
        new_nonfinite = nonfinite is not None and nonfinite != self._last_nonfinite
        self._last_nonfinite = list(nonfinite) if nonfinite else None
        w = self._writer
        if alarms or new_nonfinite or row.get("skipped") or self._sync_next:
            self._sync_next = False
            w.write_now(item)
        elif w.error is not None or w.stopped:
            w.put(item)  # raises StoreError
        else:  # `Writer.put`, without its call: every quiet step comes here
            q = w.queue
            q.append(item)
            w.weight += 1 + (per_param[0] if per_param is not None else len(params))
            if len(q) >= w.flush_steps or w.weight >= WAKE_WEIGHT:
                w.due()

    def write_alarm(self, alarm: dict[str, Any]) -> None:
        """Write an alarm and commit (after everything queued) before returning."""
        self._writer.write_now(("alarm", alarm))
        self._sync_next = True

    def write_action(self, step: int, action: str, detail: str) -> None:
        """Write an action and commit (after everything queued) before returning."""
        self._writer.write_now(("action", step, action, detail))
        self._sync_next = True

    def write_finding(self, body: dict[str, Any]) -> None:
        """Write a finding and commit (after everything queued) before returning."""
        self._writer.write_now(("finding", body))
        self._sync_next = True

    def write_rng(self, step: int, state: bytes) -> None:
        """Queue the RNG state at the start of `step` (committed with the next batch, or before
        the alarm written after it)."""
        self._writer.put(("rng", step, state))

    def flush(self) -> None:
        """Write and commit everything queued; raises StoreError if the store has failed."""
        self._writer.write_now()

    def close(self) -> None:
        """Write what is queued, stop the writer thread and close the database. Idempotent;
        never raises (a failure is in `error`, and said once on stderr)."""
        if not self._finalizer.alive:
            return
        self._finalizer()
        if self._writer.error is not None:
            err = self._writer.error
            print(f"nanguard: the run store {str(self.path)!r} stopped writing "
                  f"({type(err).__name__}: {err}); it holds the steps committed before",
                  file=sys.stderr)


def _shut(writer: Writer, db: sqlite3.Connection) -> None:
    try:
        writer.close()
        db.close()
    except Exception as exc:  # noqa: BLE001 - closing must not raise into training
        writer.error = writer.error or exc


_RECORDING = True  # False in a re-run's process (`record_nothing`)


def record_nothing() -> None:
    """For the rest of this process every new store records nothing: a re-run of a step
    (`nanguard run`'s replay, a resume point's child) must never touch the user's run
    folders, not even through a Guard the script builds itself (the first run recorded)."""
    global _RECORDING
    _RECORDING = False


def open_store(out: str | None, if_exists: str = "refuse") -> NullStore:
    """The store a new guard records to: `out=""` (or a process that `record_nothing`)
    records nothing (a `NullStore`), None a new folder `nanguard_runs/<time>-<pid>[-N]`,
    else the folder `out`.

    Raises:
        ValueError: `out` already holds a run and `if_exists` is `refuse`, or it cannot be
            written.
    """
    if out == "" or not _RECORDING:
        return NullStore()
    if out is None:
        return RunStore(unique_folder(Path("nanguard_runs")))
    folder = Path(out)
    if (folder / DB_NAME).exists():
        if if_exists == "refuse":
            raise ValueError(
                f"the run folder {out!r} already holds a run; pick another out=, or set "
                "GuardConfig(record=RecordConfig(if_exists='overwrite' or 'resume'))")
        if if_exists == "overwrite":
            for name in (DB_NAME, f"{DB_NAME}-wal", f"{DB_NAME}-shm", "report.json",
                         "nanguard_error.txt"):
                (folder / name).unlink(missing_ok=True)
    return RunStore(folder)


def unique_folder(base: Path) -> Path:
    """`base/<time>-<pid>`, with a numeric suffix if that exists: two guards started in the
    same second (a GAN's two optimizers, a sweep loop, two processes) never share a folder.
    The folder is created here (mkdir is atomic), so the name is taken."""
    stem = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    base.mkdir(parents=True, exist_ok=True)
    for k in range(10_000):
        folder = base / (stem if k == 0 else f"{stem}-{k}")
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise ValueError(f"cannot find a free run folder under {str(base)!r}; pass out=")
