"""The run store's background writer: steps are queued on the training thread and written by a
thread of their own in batched transactions.

`Writer.put` is what the hot path pays: one `deque.append` of plain Python data (no JSON, no
SQL). The writer thread wakes every `flush_seconds`, or as soon as `flush_steps` items wait,
encodes them (JSON, NaN-safe numbers) and writes them in ONE transaction. `Writer.write_now`
writes the queue and one more item and commits on the calling thread before it returns: the
run store uses it for alarms, actions, findings and the steps they concern, so their order is
kept and they survive a SIGKILL that comes right after.

Thread safety: one SQLite connection, every use of it under `Writer.lock` (the writer thread
and `write_now` never interleave). A failure while writing (disk full, a locked or corrupt
file, an unencodable value) never raises on the writer thread: it is kept in `Writer.error`,
the writer stops writing, and the next `put` / `write_now` on the calling thread raises
`StoreError` (inside the Guard's hooks, whose fail-open path stands nanguard down and marks the
run degraded; training goes on).
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
import threading
from collections import deque
from collections.abc import Callable, Sequence
from functools import lru_cache
from itertools import chain
from operator import itemgetter
from typing import Any

STEP_ROW = ("step", "time", "loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm",
            "act_max", "lr", "nonfinite", "skipped", "amp_scale", "act_limit",
            "second_moment_norm", "attn_logit_max", "clip_norm")
"""Columns of the `steps` table."""

_INSERT = {
    "steps": f"INSERT OR REPLACE INTO steps ({', '.join(STEP_ROW)}) "
             f"VALUES ({', '.join('?' * len(STEP_ROW))})",
    "param_blobs": "INSERT OR REPLACE INTO param_blobs VALUES (?,?)",
    "activations": "INSERT OR REPLACE INTO activations VALUES (?,?,?)",
    "batches": "INSERT OR REPLACE INTO batches VALUES (?,?,?,?)",
    "rng": "INSERT OR REPLACE INTO rng VALUES (?,?)",
    "alarms": "INSERT INTO alarms VALUES (?,?,?,?,?)",
    "actions": "INSERT INTO actions VALUES (?,?,?)",
    "findings": "INSERT INTO findings (body) VALUES (?)",
    "meta": "INSERT OR REPLACE INTO meta VALUES (?, ?)",
    "params": "INSERT OR REPLACE INTO params VALUES (?, ?, ?, ?)",
}


WAKE_WEIGHT = 32_768
"""Per-parameter values queued that wake the writer (about 80 steps of a 400-tensor model)."""


class StoreError(RuntimeError):
    """The run store could not write; the first error is its `__cause__`."""


def enc(x: float | None) -> float | str | None:
    """Encode a float for SQLite without losing NaN (SQLite stores NaN as NULL)."""
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    return x


_MASK = (1 << 52) - 1

RawHashes = tuple[list[Any], int, tuple[int, ...]]
"""A step's fingerprints not yet combined: (each micro-batch's per-tensor sample sums
(`watch.fingerprint.sample_sums`), micro-batch by micro-batch and tensor by tensor, as Python
ints or as the CPU tensors that hold them, not read yet (each read with its `tolist()`);
tensors per sample; samples of each micro-batch)."""


def combine_sums(raw: RawHashes) -> list[int]:
    """The masked per-sample fingerprints of `raw`: what `BatchProbe`'s device combination
    (h * 1000003 + f in wrapping int64, then the 52-bit mask) computes, in Python integers.
    Exact: int64 wrapping is arithmetic modulo 2**64, and 2**52 divides it, so the low 52 bits
    of the unbounded result (`&` on a negative int keeps two's complement bits) are the same.
    Pure Python, no torch (here, in the torch-free record package): the run store's writer
    thread calls it for quiet steps (`StepStats.sample_hashes` on the training thread when
    something reads them). The definition it reproduces: `watch.fingerprint`, `watch.batch`."""
    values, n, sizes = raw
    if values and hasattr(values[0], "tolist"):  # per-tensor sums not read yet: read here
        read: list[int] = []
        for v in values:
            read += v.tolist()
        values = read
    out: list[int] = []
    pos = 0
    for size in sizes:
        h = values[pos : pos + size]
        pos += size
        for _ in range(n - 1):
            f = values[pos : pos + size]
            pos += size
            h = [a * 1000003 + b for a, b in zip(h, f, strict=True)]
        out += [v & _MASK for v in h]
    return out


def batch_hash(samples: list[int]) -> str:
    """Fingerprint of a whole batch from its per-sample fingerprints."""
    return _hash(repr(samples))


def _hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _json_list(values: list[Any] | None) -> str:
    """A list of ints or strings as JSON (for ints, `repr` is that JSON, and cheaper)."""
    if not values:
        return "[]"
    if all(type(v) is int for v in values):
        return repr(values)
    return json.dumps(values)


@lru_cache(maxsize=64)
def _template(n: int, keys: tuple[str, ...]) -> tuple[str, Callable[[dict[int, float]], Any]]:
    """The %-format of `n` parameters' rows, and a getter of values 0..n-1 of a dict."""
    state = ",".join(json.dumps(k).replace("%", "%%") + ":%.9g" for k in keys)
    return ",".join(["[%.9g,%.9g,{" + state + "}]"] * n), itemgetter(*range(n))


def _num(v: float | None, real_inf: bool) -> str:
    if v is None:
        return "null"
    if math.isnan(v):
        return '"nan"'
    if math.isinf(v):  # 1e999 reads back as an infinite REAL (SQLite and Python alike)
        return ("1e999" if v > 0 else "-1e999") if real_inf else f'"{v}"'
    return f"{v:.9g}"


PerParam = tuple[int, dict[int, float], dict[int, float], dict[str, dict[int, float]]]
"""(number of parameters, grad norms, param norms, {state key: norms}), by parameter index."""


def param_blob(per_param: PerParam) -> str:
    """One step's per-parameter values as the `param_blobs.rows` JSON: one array per parameter,
    `[grad norm, param norm, {state key: norm}]`.

    Numbers have 9 significant digits (exact for the float32 norms the probes produce); a
    missing grad or param norm is null, a missing state key is left out; NaN is the string
    "nan"; an infinite grad/param norm is 1e999 (read back as an infinite REAL, as `enc` stores
    it), an infinite state norm the string "inf" (as the one-row-per-parameter stores had it)."""
    n, grads, params, states = per_param
    if n <= 0:
        return "[]"
    cols = [grads, params, *states.values()]
    fmt, get = _template(n, tuple(states))
    try:
        vals = [get(c) for c in cols] if n > 1 else [(get(c),) for c in cols]
        flat = tuple(chain.from_iterable(zip(*vals, strict=True)))
        if math.isfinite(sum(flat)):  # every value finite (a sum that overflows: slow path)
            return f"[{fmt % flat}]"
    except (KeyError, TypeError):  # a parameter without a value (no grad, no state)
        pass
    rows = []
    for i in range(n):
        state = ",".join(f"{json.dumps(k)}:{_num(v[i], False)}" for k, v in states.items()
                         if i in v)
        rows.append(f"[{_num(grads.get(i), True)},{_num(params.get(i), True)},{{{state}}}]")
    return "[" + ",".join(rows) + "]"


def from_rows(params: Sequence[tuple[int, float | None, float | None, dict[str, float]]]
              ) -> PerParam:
    """The older `params=` form (one (id, grad, param, state) tuple per parameter) as PerParam."""
    grads = {i: g for i, g, _, _ in params if g is not None}
    norms = {i: p for i, _, p, _ in params if p is not None}
    states: dict[str, dict[int, float]] = {}
    for i, _, _, s in params:
        for k, v in s.items():
            states.setdefault(k, {})[i] = v
    return max(i for i, *_ in params) + 1, grads, norms, states


def encode(items: list[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    """Queued items to rows, by table."""
    out: dict[str, list[tuple[Any, ...]]] = {k: [] for k in _INSERT}
    for kind, *a in items:
        if kind == "step":
            row, when, per_param, acts, batch, alarms = a
            step = row["step"]
            get = row.get
            out["steps"].append((
                step, when, enc(get("loss")), enc(get("grad_norm")), enc(get("param_norm")),
                enc(get("update_ratio")), enc(get("momentum_norm")), enc(get("act_max")),
                enc(get("lr")), _json_list(get("nonfinite")), int(get("skipped", False)),
                enc(get("amp_scale")), enc(get("act_limit")), enc(get("second_moment_norm")),
                enc(get("attn_logit_max")), enc(get("clip_norm"))))
            if per_param is not None:
                out["param_blobs"].append((step, param_blob(per_param)))
            if acts:
                out["activations"].extend((step, m, enc(v)) for m, v in acts.items())
            if batch is not None:
                fp, samples, bad = batch
                if type(samples) is tuple:  # a CPU step's per-tensor sums, combined here
                    samples = combine_sums(samples)
                    text = repr(samples) if samples else "[]"  # ints: repr is their JSON
                else:
                    text = _json_list(samples)
                out["batches"].append((step, fp or _hash(text), text, _json_list(bad)))
            out["alarms"].extend(_alarm(x) for x in alarms)
        elif kind == "alarm":
            out["alarms"].append(_alarm(a[0]))
        elif kind == "action":
            out["actions"].append(tuple(a))
        elif kind == "rng":
            out["rng"].append(tuple(a))
        elif kind == "finding":
            out["findings"].append((json.dumps(a[0]),))
        elif kind == "meta":
            out["meta"].extend((k, json.dumps(v)) for k, v in a[0].items())
        elif kind == "params":
            out["params"].extend((i, n, json.dumps(list(s)), k)
                                 for i, (n, s, k) in enumerate(a[0]))
    return out


def _alarm(a: dict[str, Any]) -> tuple[Any, ...]:
    return (a["step"], a["kind"], a["signal"], enc(a["value"]), a["message"])


class Writer:
    """Owns the store's connection and the thread that writes it.

    Args:
        db: the open connection (`check_same_thread=False`); used only under `lock`.
        flush_steps: wake the writer as soon as this many items are queued.
        flush_seconds: ...or after this long, whichever comes first.
        after_commit: called on the writer thread, under `lock`, after each of its commits
            (the store's compaction).
    """

    def __init__(self, db: sqlite3.Connection, *, flush_steps: int, flush_seconds: float,
                 after_commit: Callable[[], None] | None = None) -> None:
        self.db = db
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.queue: deque[tuple[Any, ...]] = deque()
        """Items waiting for the writer thread. `put` appends to it; so does the run store's
        `write_step` itself, the same three lines without the call (the hot path)."""
        # Weight of an item: 1 + its per-parameter values (a step of a 400-tensor model weighs
        # 401). Wake the writer at `flush_steps` items or WAKE_WEIGHT; past 16x that the
        # writer lags behind and the caller writes (bounds the queue's memory).
        self.flush_steps = flush_steps
        self.weight = 0
        self._flush_seconds = flush_seconds
        self._after_commit = after_commit
        self._wake = threading.Event()
        self.stopped = False
        """Set by `close`: `put` raises from then on (as after a failure: `error`)."""
        self._thread = threading.Thread(target=self._loop, name="nanguard-run-store",
                                        daemon=True)
        self._thread.start()

    def put(self, item: tuple[Any, ...], weight: int = 1) -> None:
        """Queue one item (the hot path: no encoding, no SQL). `weight`: 1 + the number of
        per-parameter values it holds. Raises StoreError once the writer has failed or the
        store is closed."""
        if self.error is not None or self.stopped:
            self._raise()
        q = self.queue
        q.append(item)
        self.weight += weight  # read and reset by the writer: an estimate is enough
        if len(q) >= self.flush_steps or self.weight >= WAKE_WEIGHT:
            self.due()

    def due(self) -> None:
        """Enough waits (`flush_steps` items or `WAKE_WEIGHT`): wake the writer thread, or,
        when it lags 16x behind, write here (compaction too)."""
        if len(self.queue) >= 16 * self.flush_steps or self.weight >= 16 * WAKE_WEIGHT:
            self.write_now(maintain=True)
        else:
            self._wake.set()

    def write_now(self, item: tuple[Any, ...] | None = None, *, maintain: bool = False
                  ) -> None:
        """Write the queue, then `item`, and commit, on the calling thread, before returning
        (then run `after_commit` if `maintain`). Raises StoreError if it (or the writer
        earlier) failed."""
        if self.stopped:
            self._raise()
        with self.lock:
            if item is not None:
                self.queue.append(item)
            self._drain()
            if maintain:
                self._maintain()
        if self.error is not None:
            self._raise()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread and write what is left (never raises; see `error`)."""
        self.stopped = True
        self._wake.set()
        self._thread.join(timeout)
        with self.lock:
            self._drain()

    def _raise(self) -> None:
        if self.error is None:
            raise StoreError("the run store is closed")
        raise StoreError(f"the run store stopped writing ({type(self.error).__name__}: "
                         f"{self.error})") from self.error

    def _drain(self) -> None:
        """Encode and write every queued item, `flush_steps` per transaction (the caller holds
        `lock`). Items queued before an item are committed before it, or with it."""
        q = self.queue
        self.weight = 0
        while q and self.error is None:
            # At most `flush_steps` items per transaction: the WAL (which cannot be
            # checkpointed during a transaction) stays small when the writer catches up.
            items = [q.popleft() for _ in range(min(len(q), self.flush_steps))]
            try:
                rows = encode(items)
                with self.db:
                    for table, values in rows.items():
                        if values:
                            self.db.executemany(_INSERT[table], values)
            except Exception as exc:  # noqa: BLE001 - kept, re-raised on the calling thread
                self.error = exc
        q.clear()  # after a failure nothing more is written

    def _loop(self) -> None:
        while not self.stopped:
            self._wake.wait(self._flush_seconds)
            self._wake.clear()
            if self.stopped:
                return
            with self.lock:
                self._drain()
                self._maintain()

    def _maintain(self) -> None:
        if self._after_commit is not None and self.error is None:
            try:
                self._after_commit()
            except Exception as exc:  # noqa: BLE001 - kept, re-raised on the calling thread
                self.error = exc
