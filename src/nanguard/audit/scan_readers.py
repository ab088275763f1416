"""Readers that turn a data file into tables streamed as float64 chunks of rows.

Each reader yields `Table`s. A table has column names and a `chunks()` iterator of `Chunk`
(row offset, a (rows, columns) float64 array, and a mask of missing cells). Only one chunk
is resident at a time, except for .npz members, which NumPy cannot memory-map and which are
therefore loaded whole (one group of members at a time).

CSV and Parquet go through pyarrow's streaming readers; no hand-written parsing.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import sys
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanguard.audit.common import AuditInputError, one_line, require

# Values per chunk: about 8 MB of float64, whatever the number of columns.
CHUNK_VALUES = 1 << 20
SUFFIXES = (".csv", ".tsv", ".parquet", ".pq", ".npy", ".npz", ".pt", ".pth")


@dataclass(kw_only=True)
class Chunk:
    start: int  # index of the chunk's first row in the table (0-based)
    values: np.ndarray  # (rows, columns) float64; missing cells are NaN
    missing: np.ndarray | None = None  # (rows, columns) bool, True where the cell is empty


@dataclass(kw_only=True)
class Table:
    """A stream of rows with named numeric columns."""

    name: str
    columns: list[str]
    chunks: Callable[[], Iterator[Chunk]]
    rows: int | None = None  # known up front for binary formats; None for CSV
    skipped: list[str] = field(default_factory=list)  # non-numeric columns
    mixed: dict[str, tuple[int, list[tuple[int, str]]]] = field(default_factory=dict)
    """Text columns of a CSV whose first rows are numbers but for a few values (a stray
    string in a numeric column): name -> (values that parse as numbers, the first few that do
    not as (data row, text))."""
    position: Callable[[], float] = lambda: 0.0  # progress, in units of `total`
    total: float | None = None


def rows_per_chunk(ncols: int) -> int:
    return max(1, CHUNK_VALUES // max(ncols, 1))


def check_file(path: str) -> None:
    if not os.path.exists(path):
        raise AuditInputError(f"{path}: no such file")
    if os.path.isdir(path):
        raise AuditInputError(f"{path}: is a directory, expected a data file")
    if os.path.getsize(path) == 0:
        raise AuditInputError(f"{path}: empty file (0 bytes)")


class _PacedFile(io.RawIOBase):
    """A read-only file that keeps pyarrow's background reader at most `ahead` bytes ahead
    of the batches consumed so far.

    pyarrow's streaming CSV reader reads ahead as fast as the disk allows; on a fast disk it
    buffers hundreds of MB of a large file before the first batches are consumed. Reads
    block here until the consumer catches up, except while the consumer is itself waiting
    for a batch (then blocking would deadlock), so memory stays at a few blocks.
    """

    def __init__(self, path: str, ahead: int) -> None:
        super().__init__()
        self._f = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._ahead = ahead
        self._cond = threading.Condition()
        self._consumed = 0
        self._waiting = False
        self._closed = False
        self.position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        def may_read() -> bool:
            lead = self.position - self._consumed
            # A consumer blocked on the next batch gets one extra window, never unbounded.
            return self._closed or lead < self._ahead or (self._waiting and lead < 2 * self._ahead)

        with self._cond:
            while not self._cond.wait_for(may_read, timeout=1.0):
                if self._waiting:
                    break  # the reader needs more than the window for one batch: let it
        n = self._f.readinto(buf)
        self.position += n
        return n

    def consumed(self, nbytes: int) -> None:
        with self._cond:
            self._consumed += nbytes
            self._cond.notify_all()

    @contextlib.contextmanager
    def consumer_waiting(self) -> Iterator[None]:
        with self._cond:
            self._waiting = True
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                self._waiting = False

    def close(self) -> None:
        with self._cond:
            self._closed = True  # release a blocked reader thread for good
            self._cond.notify_all()
        self._f.close()
        super().close()


def _arrow_column(col: Any) -> tuple[np.ndarray, np.ndarray | None]:
    """(float64 values with NaN at nulls, null mask or None) of one pyarrow column."""
    pa = require("pyarrow", "data")
    missing = None
    if col.null_count:
        missing = np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if pa.types.is_boolean(col.type) or pa.types.is_decimal(col.type):
        col = col.cast(pa.float64())
    values = np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.float64)
    return values, missing


def _arrow_chunk(batch: Any, start: int) -> Chunk:
    cols = [_arrow_column(batch.column(i)) for i in range(batch.num_columns)]
    values = np.stack([v for v, _ in cols], axis=1) if cols else np.empty((batch.num_rows, 0))
    missing = None
    if any(m is not None for _, m in cols):
        missing = np.stack(
            [m if m is not None else np.zeros(batch.num_rows, bool) for _, m in cols], axis=1
        )
    return Chunk(start=start, values=values, missing=missing)


def _is_numeric(pa: Any, typ: Any) -> bool:
    t = pa.types
    return bool(t.is_integer(typ) or t.is_floating(typ) or t.is_boolean(typ) or t.is_null(typ))


def read_csv(path: str, delimiter: str = ",") -> list[Table]:
    pa = require("pyarrow", "data")
    pcsv = require("pyarrow.csv", "data")
    with open(path, "rb") as f:
        head = f.readline(1 << 20)
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AuditInputError(f"{path}: header is not valid UTF-8 ({exc.reason})") from None
    read_opts = pcsv.ReadOptions(block_size=1 << 22)
    parse_opts = pcsv.ParseOptions(delimiter=delimiter)
    # Only an empty cell is missing: "nan" and "inf" must stay NaN and inf, not null.
    null_opts: dict[str, Any] = {"null_values": [""], "strings_can_be_null": False}
    try:
        with pcsv.open_csv(
            path,
            read_options=read_opts,
            parse_options=parse_opts,
            convert_options=pcsv.ConvertOptions(**null_opts),
        ) as probe:
            schema = probe.schema
            text = [f.name for f in schema if pa.types.is_string(f.type)]
            first = probe.read_next_batch() if text else None
    except StopIteration:
        first = None
    except (pa.ArrowException, UnicodeDecodeError, OSError) as exc:
        raise AuditInputError(f"{path}: cannot parse as CSV ({one_line(exc)})") from None
    binary = [f.name for f in schema if pa.types.is_binary(f.type)]
    if binary:
        raise AuditInputError(f"{path}: column '{binary[0]}' is not valid UTF-8 text")
    # Types are inferred from the first block only; pin numeric columns to float64 so a
    # "1.5" after a block of integers does not break the stream.
    numeric = [f.name for f in schema if _is_numeric(pa, f.type)]
    skipped = [f.name for f in schema if f.name not in numeric]
    mixed = _mostly_numbers(first) if first is not None else {}
    types = {name: pa.float64() for name in numeric}
    convert = pcsv.ConvertOptions(column_types=types, include_columns=numeric, **null_opts)
    size = os.path.getsize(path)
    state = {"pos": 0.0}

    def chunks() -> Iterator[Chunk]:
        start = 0
        with _PacedFile(path, ahead=4 * read_opts.block_size) as f:
            try:
                reader = pcsv.open_csv(
                    f, read_options=read_opts, parse_options=parse_opts, convert_options=convert
                )
                while True:
                    with f.consumer_waiting():
                        batch = next(reader, None)
                    if batch is None:
                        break
                    f.consumed(read_opts.block_size)
                    state["pos"] = float(f.position)
                    if batch.num_rows:
                        yield _arrow_chunk(batch, start)
                        start += batch.num_rows
            except (pa.ArrowException, UnicodeDecodeError) as exc:
                raise AuditInputError(
                    f"{path}: bad CSV after data row {start} ({one_line(exc)})"
                ) from None

    return [
        Table(
            name=path,
            columns=numeric,
            chunks=chunks,
            skipped=skipped,
            mixed=mixed,
            position=lambda: state["pos"],
            total=float(size),
        )
    ]


MOSTLY = 0.9
"""Share of a text column's non-empty first-block values that must parse as numbers for it
to be a numeric column with stray text in it."""


def _mostly_numbers(batch: Any) -> dict[str, tuple[int, list[tuple[int, str]]]]:
    """The text columns of `batch` (a CSV's first block) whose non-empty values are numbers
    but for at most 1 - `MOSTLY` of them: name -> (numbers, the first 5 others)."""
    pa = require("pyarrow", "data")
    out: dict[str, tuple[int, list[tuple[int, str]]]] = {}
    for name, col in zip(batch.schema.names, batch.columns, strict=True):
        if not pa.types.is_string(col.type):
            continue
        ok, bad = 0, []
        for row, v in enumerate(col.to_pylist()):
            if v is None or not v.strip():
                continue
            try:
                float(v)
                ok += 1
            except ValueError:
                bad.append((row, v))
        if bad and ok >= MOSTLY * (ok + len(bad)):
            out[name] = (ok, bad[:5])
    return out


def read_parquet(path: str) -> list[Table]:
    pa = require("pyarrow", "data")
    pq = require("pyarrow.parquet", "data")
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as exc:
        raise AuditInputError(f"{path}: not a readable Parquet file ({one_line(exc)})") from None
    numeric = [f.name for f in schema if _is_numeric(pa, f.type) or pa.types.is_decimal(f.type)]
    skipped = [f.name for f in schema if f.name not in numeric]
    nrows = pf.metadata.num_rows
    state = {"pos": 0.0}

    def chunks() -> Iterator[Chunk]:
        start = 0
        try:
            for batch in pf.iter_batches(batch_size=rows_per_chunk(len(numeric)), columns=numeric):
                yield _arrow_chunk(batch, start)
                start += batch.num_rows
                state["pos"] = float(start)
        except (pa.ArrowException, OSError) as exc:
            raise AuditInputError(f"{path}: corrupt Parquet data ({one_line(exc)})") from None

    return [
        Table(
            name=path,
            columns=numeric,
            chunks=chunks,
            rows=nrows,
            skipped=skipped,
            position=lambda: state["pos"],
            total=float(nrows),
        )
    ]


def _column_names(name: str | None, arr: Any) -> list[str]:
    width = math.prod(arr.shape[1:])
    if name is None:
        return [str(j) for j in range(width)]
    return [name] if arr.ndim == 1 else [f"{name}[{j}]" for j in range(width)]


def arrays_to_tables(label: str, members: list[tuple[str | None, Any]]) -> list[Table]:
    """Tables from arrays (NumPy or torch); arrays with the same length form one table."""
    groups: dict[int, list[tuple[str | None, Any]]] = {}
    for name, arr in members:
        if arr.ndim == 0:
            continue  # a scalar is not a data set
        if str(arr.dtype) in ("object", "torch.complex64", "torch.complex128") or (
            isinstance(arr, np.ndarray) and arr.dtype.kind not in "biuf"
        ):
            raise AuditInputError(f"{label}: array '{name or 0}' has unsupported dtype {arr.dtype}")
        groups.setdefault(int(arr.shape[0]), []).append((name, arr))
    if not groups:
        raise AuditInputError(f"{label}: no arrays with rows to scan")
    tables = []
    for nrows, group in groups.items():
        columns = [c for name, arr in group for c in _column_names(name, arr)]
        tables.append(_array_table(label, group, columns, nrows))
    return tables


def _release(arr: Any) -> None:
    """Drop the pages of a memory-mapped array that were read so far from this process's
    resident set: they are clean file pages, so the kernel can re-read them if needed, and
    RSS stays at one chunk instead of growing to the file size."""
    mm = getattr(arr, "_mmap", None)
    if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, ValueError):  # only an optimisation
            mm.madvise(mmap.MADV_DONTNEED)


def _to_numpy(block: Any) -> np.ndarray:
    if not isinstance(block, np.ndarray):  # a torch tensor
        import torch

        block = block.detach().to(torch.float64).numpy()
    return np.asarray(block, dtype=np.float64)


def _array_table(
    label: str, group: list[tuple[str | None, Any]], columns: list[str], nrows: int
) -> Table:
    state = {"pos": 0.0}
    step = rows_per_chunk(len(columns))

    def chunks() -> Iterator[Chunk]:
        for start in range(0, nrows, step):
            try:
                parts = [
                    _to_numpy(arr[start : start + step]).reshape(-1, math.prod(arr.shape[1:]))
                    for _, arr in group
                ]
            except (ValueError, OSError) as exc:
                raise AuditInputError(f"{label}: cannot read rows ({one_line(exc)})") from None
            state["pos"] = float(min(start + step, nrows))
            yield Chunk(start=start, values=np.concatenate(parts, axis=1))
            for _, arr in group:
                _release(arr)

    names = [n for n, _ in group if n is not None]
    title = f"{label} [{', '.join(names)}]" if names else label
    return Table(
        name=title,
        columns=columns,
        chunks=chunks,
        rows=nrows,
        position=lambda: state["pos"],
        total=float(nrows),
    )


def _check_magic(path: str, magic: bytes, what: str) -> None:
    with open(path, "rb") as f:
        if f.read(len(magic)) != magic:
            raise AuditInputError(f"{path}: not a {what} file (bad magic bytes)")


def read_npy(path: str) -> list[Table]:
    _check_magic(path, b"\x93NUMPY", ".npy")
    try:
        # mmap: rows are paged in chunk by chunk, never the whole array.
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise AuditInputError(f"{path}: not a readable .npy file ({one_line(exc)})") from None
    if arr.dtype.names:
        raise AuditInputError(f"{path}: structured arrays are not supported")
    return arrays_to_tables(path, [(None, arr)])


def read_npz(path: str) -> list[Table]:
    _check_magic(path, b"PK", ".npz (zip)")
    try:
        with np.load(path, allow_pickle=False) as npz:
            members = [(name, npz[name]) for name in npz.files]
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        raise AuditInputError(f"{path}: not a readable .npz file ({one_line(exc)})") from None
    return arrays_to_tables(path, list(members))


_trusted: set[str] = set()


@contextlib.contextmanager
def trusting(path: str) -> Iterator[None]:
    """While in this block, `path` (a .pt / .pth file the user trusts: `nanguard scan --trust`)
    is loaded with `weights_only=False`, so numpy arrays and other objects inside it can be
    read. Loading a pickle runs code from it: never for a file from elsewhere."""
    key = os.path.realpath(path)
    _trusted.add(key)
    try:
        yield
    finally:
        _trusted.discard(key)


def _load_trusted(path: str) -> Any:
    import torch

    print(f"nanguard scan: warning: loading {path} with weights_only=False (--trust): it may "
          "run code stored in the file", file=sys.stderr)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any failure is a one-line input error
        raise AuditInputError(f"{path}: could not be loaded ({one_line(exc)})") from None


def read_torch(path: str) -> list[Table]:
    import torch

    from nanguard.audit.ckpt_load import flatten, load_torch, sniff

    kind = sniff(path)
    if kind == "safetensors":
        raise AuditInputError(f"{path}: a safetensors checkpoint; use `nanguard audit`")
    trusted = os.path.realpath(path) in _trusted
    try:
        obj = _load_trusted(path) if trusted else load_torch(path, kind)
    except AuditInputError as exc:
        if trusted or "unsafe" not in str(exc):
            raise
        raise AuditInputError(f"{exc}; if you made this file yourself, `nanguard scan --trust "
                              f"{path}` loads it") from None
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return arrays_to_tables(path, [(None, obj)])
    members = [(n, t) for n, t in flatten(obj) if isinstance(t, torch.Tensor)
               or (trusted and isinstance(t, np.ndarray) and t.dtype.kind in "biuf")]
    if not members:
        raise AuditInputError(f"{path}: holds no tensors")
    return arrays_to_tables(path, [(n, t) for n, t in members])


def open_tables(path: str) -> list[Table]:
    """Tables of a data file, chosen by extension.

    Raises:
        AuditInputError: missing, unreadable, or an unsupported extension.
    """
    path = os.fspath(path)
    check_file(path)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".csv":
        return read_csv(path)
    if ext == ".tsv":
        return read_csv(path, "\t")
    if ext in (".parquet", ".pq"):
        return read_parquet(path)
    if ext == ".npy":
        return read_npy(path)
    if ext == ".npz":
        return read_npz(path)
    if ext in (".pt", ".pth"):
        return read_torch(path)
    raise AuditInputError(
        f"{path}: unsupported file type '{ext or '(none)'}' (expected {', '.join(SUFFIXES)})"
    )
