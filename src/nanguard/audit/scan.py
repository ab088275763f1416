"""Scan a data set for values that break training: NaN / Inf / missing cells with their row
and column, extreme magnitudes, constant columns (a later division by a zero std), broken
one-hot groups and labels outside [0, num_classes), plus per-column mean and std.

Rows and columns are 0-based: row 137 is `df.iloc[137]` / `dataset[137]` (the CSV header is
not a row), column 3 is the fourth column. Everything is computed in one pass over chunks of
rows, so memory is bounded by the chunk size, not by the file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanguard.audit.common import (
    AuditFinding,
    AuditInputError,
    FieldsToDict,
    RunningMoments,
    progress,
)
from nanguard.audit.scan_onehot import OneHotGroup, candidate_groups, explicit_groups
from nanguard.audit.scan_readers import Chunk, Table, open_tables

MAX_ROWS_REPORTED = 10  # row numbers kept per finding; counts are always exact


@dataclass(kw_only=True)
class ScanConfig:
    """What to check, beyond NaN / Inf / missing, which are always checked."""

    max_abs: float = 1e6
    """Values with a larger magnitude are reported as extreme (float16 overflows at 65504)."""
    label: str | None = None
    """Name of an integer class-label column, checked for integers in [0, num_classes)."""
    num_classes: int | None = None
    """Number of classes; without it labels are only checked to be integers >= 0."""
    onehot: Sequence[str] = ()
    """Column-name prefixes that must form one-hot groups (0/1, exactly one 1 per row)."""
    auto_onehot: bool = True
    """Also find 0/1 column groups sharing a name prefix and check the rows that break them."""
    ignore: Sequence[str] = ()
    """Columns to leave out of the extreme, zero-variance and one-hot checks."""


@dataclass(kw_only=True)
class ColumnStats(FieldsToDict):
    name: str
    index: int
    count: int  # finite values
    mean: float | None
    std: float | None
    min: float | None
    max: float | None
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    missing: int = 0


@dataclass(kw_only=True)
class TableReport:
    name: str
    rows: int
    columns: list[ColumnStats] = field(default_factory=list)
    skipped_columns: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rows": self.rows,
            "skipped_columns": self.skipped_columns,
            "columns": [c.to_dict() for c in self.columns],
        }


@dataclass(kw_only=True)
class ScanReport:
    """What `scan_file` / `scan_dataset` found."""

    source: str
    tables: list[TableReport] = field(default_factory=list)
    findings: list[AuditFinding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ok": self.ok,
            "tables": [t.to_dict() for t in self.tables],
            "findings": [f.to_dict() for f in self.findings],
        }


class _Hits:
    """Exact count of cells hit per column, and the first rows hit."""

    def __init__(self, ncols: int) -> None:
        self.count = np.zeros(ncols, dtype=np.int64)
        self.rows: dict[int, list[int]] = {}
        self.values: dict[int, list[float]] = {}

    def add(self, mask: np.ndarray, chunk: Chunk) -> None:
        per_col = mask.sum(axis=0)
        if not per_col.any():
            return
        self.count += per_col
        for col in np.flatnonzero(per_col):
            kept = self.rows.setdefault(int(col), [])
            if len(kept) < MAX_ROWS_REPORTED:
                idx = np.flatnonzero(mask[:, col])[: MAX_ROWS_REPORTED - len(kept)]
                kept.extend(int(chunk.start + i) for i in idx)
                self.values.setdefault(int(col), []).extend(
                    float(v) for v in chunk.values[idx, col]
                )


def _rows_text(rows: list[int], count: int) -> str:
    shown = ", ".join(map(str, rows))
    return f"row {shown}" if count == 1 else f"rows {shown}{', ...' if count > len(rows) else ''}"


class _TableScanner:
    def __init__(self, table: Table, config: ScanConfig) -> None:
        self.table, self.config = table, config
        cols = table.columns
        n = len(cols)
        self.moments = RunningMoments(n)
        self.hits = {k: _Hits(n) for k in ("nan", "posinf", "neginf", "missing", "extreme")}
        self.label_bad = _Hits(n)
        self.rows = 0
        ignored = set(config.ignore) | ({config.label} if config.label else set())
        unknown = [c for c in ignored if c not in cols]
        if unknown:
            raise AuditInputError(
                f"no column named {unknown[0]!r} in {table.name} "
                f"(columns: {', '.join(cols[:8])}{'...' if n > 8 else ''})"
            )
        self.checked = np.array([c not in ignored for c in cols], dtype=bool)
        self.label_idx = cols.index(config.label) if config.label else None
        self.groups: list[OneHotGroup] = explicit_groups(cols, config.onehot, ignored)
        if config.auto_onehot:
            taken = {i for g in self.groups for i in g.index}
            self.groups += candidate_groups(cols, ignored, taken)

    def feed(self, chunk: Chunk) -> None:
        v = chunk.values
        self.rows += v.shape[0]
        missing = chunk.missing if chunk.missing is not None else np.zeros(v.shape, bool)
        isnan = np.isnan(v)
        self.hits["missing"].add(missing, chunk)
        self.hits["nan"].add(isnan & ~missing, chunk)
        self.hits["posinf"].add(np.isposinf(v), chunk)
        self.hits["neginf"].add(np.isneginf(v), chunk)
        finite = ~isnan & ~np.isinf(v)
        self.moments.update(v, finite)
        with np.errstate(invalid="ignore"):
            self.hits["extreme"].add(
                finite & (np.abs(v) > self.config.max_abs) & self.checked, chunk
            )
        if self.label_idx is not None:
            self.label_bad.add(
                self._bad_labels(v[:, [self.label_idx]]), _shift(chunk, self.label_idx)
            )
        for group in self.groups:
            group.feed(v, chunk.start)

    def _bad_labels(self, y: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(y) | (y != np.round(y)) | (y < 0)
            if self.config.num_classes is not None:
                bad |= y >= self.config.num_classes
        return np.asarray(bad)

    def report(self) -> tuple[TableReport, list[AuditFinding]]:
        m, cols = self.moments, self.table.columns
        std = m.std
        stats = [
            ColumnStats(
                name=c,
                index=i,
                count=int(m.count[i]),
                mean=float(m.mean[i]) if m.count[i] else None,
                std=float(std[i]) if m.count[i] else None,
                min=float(m.min[i]) if m.count[i] else None,
                max=float(m.max[i]) if m.count[i] else None,
                nan=int(self.hits["nan"].count[i]),
                posinf=int(self.hits["posinf"].count[i]),
                neginf=int(self.hits["neginf"].count[i]),
                missing=int(self.hits["missing"].count[i]),
            )
            for i, c in enumerate(cols)
        ]
        table = TableReport(
            name=self.table.name,
            rows=self.rows,
            columns=stats,
            skipped_columns=list(self.table.skipped),
        )
        return table, self._findings(stats)

    def _cell_findings(self, kind: str, hits: _Hits) -> list[AuditFinding]:
        words = {
            "nan": ("NaN", "error"),
            "posinf": ("+inf", "error"),
            "neginf": ("-inf", "error"),
            "missing": ("missing (empty)", "warning"),
        }
        word, severity = words[kind]
        fixes = {"missing": "impute or drop these rows before training"}
        out = []
        for col, rows in sorted(hits.rows.items()):
            name, n = self.table.columns[col], int(hits.count[col])
            out.append(
                AuditFinding(
                    code=kind,
                    severity=severity,
                    location=f"row {rows[0]}, column {col} {name!r}",
                    message=f"column {col} {name!r}: {n} {word} value{'s' if n > 1 else ''} at "
                    f"{_rows_text(rows, n)}",
                    fix=fixes.get(kind, "fix or drop these rows; the loss turns NaN on them"),
                    details={"column": col, "column_name": name, "count": n, "rows": rows},
                )
            )
        return out

    def _findings(self, stats: list[ColumnStats]) -> list[AuditFinding]:
        out: list[AuditFinding] = []
        for kind in ("nan", "posinf", "neginf", "missing"):
            out += self._cell_findings(kind, self.hits[kind])
        ext = self.hits["extreme"]
        for col, rows in sorted(ext.rows.items()):
            name, n = self.table.columns[col], int(ext.count[col])
            peak = max(abs(stats[col].min or 0), abs(stats[col].max or 0))
            out.append(
                AuditFinding(
                    code="extreme",
                    severity="warning",
                    location=f"row {rows[0]}, column {col} {name!r}",
                    message=f"column {col} {name!r}: {n} value{'s' if n > 1 else ''} with |x| > "
                    f"{self.config.max_abs:g} (largest {peak:.4g}) at {_rows_text(rows, n)}",
                    fix="normalise or clip this feature, or check for sentinel values",
                    details={
                        "column": col,
                        "column_name": name,
                        "count": n,
                        "rows": rows,
                        "values": ext.values[col],
                    },
                )
            )
        for s in stats:
            if self.checked[s.index] and s.count >= 2 and s.min == s.max:
                out.append(
                    AuditFinding(
                        code="zero_variance",
                        severity="warning",
                        location=f"column {s.index} {s.name!r}",
                        message=f"column {s.index} {s.name!r} is constant ({s.min:g}) over "
                        f"{s.count} values: standardising it divides by a zero std",
                        fix="drop the column, or add eps to the std: (x - mean) / (std + 1e-8)",
                        details={"column": s.index, "column_name": s.name, "value": s.min},
                    )
                )
        if self.label_idx is not None:
            out += self._label_findings()
        for group in self.groups:
            finding = group.finding(self.rows)
            if finding is not None:
                out.append(finding)
        return out

    def _label_findings(self) -> list[AuditFinding]:
        hits, col = self.label_bad, self.label_idx
        assert col is not None
        n = int(hits.count[0])
        if not n:
            return []
        rows, values = hits.rows[0], hits.values[0]
        k = self.config.num_classes
        allowed = f"integers in [0, {k})" if k is not None else "integers >= 0"
        shown = ", ".join(f"{r} ({v:g})" for r, v in zip(rows, values, strict=True))
        return [
            AuditFinding(
                code="label_out_of_range",
                severity="error",
                location=f"row {rows[0]}, column {col} {self.config.label!r}",
                message=f"label column {self.config.label!r}: {n} value{'s' if n > 1 else ''} not "
                f"{allowed}, at rows {shown}{', ...' if n > len(rows) else ''}",
                fix="fix the labels, or set num_classes to the real number of classes "
                "(cross_entropy fails or reads out of bounds on them)",
                details={"column": col, "count": n, "rows": rows, "values": values},
            )
        ]


def _shift(chunk: Chunk, col: int) -> Chunk:
    """The chunk seen through one column, so `_Hits` records label values by row."""
    return Chunk(start=chunk.start, values=chunk.values[:, [col]])


def scan_tables(source: str, tables: list[Table], config: ScanConfig | None = None) -> ScanReport:
    """Scan already-opened tables (the engine behind `scan_file` and `scan_dataset`)."""
    config = config or ScanConfig()
    if config.num_classes is not None and config.num_classes < 1:
        raise AuditInputError(f"num_classes must be >= 1, got {config.num_classes}")
    report = ScanReport(source=source)
    for table in tables:
        scanner = _TableScanner(table, config)
        with progress(table.total, f"scan {os.path.basename(table.name)}") as bar:
            for chunk in table.chunks():
                scanner.feed(chunk)
                bar.update(table.position())
        if scanner.rows == 0:
            raise AuditInputError(f"{table.name}: no data rows to scan")
        table_report, findings = scanner.report()
        report.tables.append(table_report)
        for name, (ok, bad) in table.mixed.items():
            rows = ", ".join(f"row {r}: {v!r}" for r, v in bad)
            report.findings.append(
                AuditFinding(
                    code="non_numeric_values",
                    severity="error",
                    location=f"column '{name}'",
                    message=f"column '{name}' holds numbers ({ok} in the first rows) and text "
                    f"({rows}{', ...' if len(bad) == 5 else ''}): it could not be scanned as "
                    "numbers; `float()` stops on that text, `pd.to_numeric(errors='coerce')` "
                    "turns it into NaN",
                    fix="fix or drop these rows at load time",
                    details={"numeric": ok, "text": [list(b) for b in bad]},
                )
            )
        text = [c for c in table.skipped if c not in table.mixed]
        if text:
            report.findings.append(
                AuditFinding(
                    code="skipped_columns",
                    severity="info",
                    location=table.name,
                    message=f"{len(text)} non-numeric column(s) not scanned: "
                    f"{', '.join(text[:5])}{'...' if len(text) > 5 else ''}",
                )
            )
        report.findings.extend(findings)
    return report


def scan_file(path: str | os.PathLike[str], config: ScanConfig | None = None) -> ScanReport:
    """Scan a CSV / TSV, Parquet, .npy, .npz or torch tensor file.

    Raises:
        AuditInputError: missing, unreadable or unsupported file, or a bad config.
    """
    path = os.fspath(path)
    return scan_tables(path, open_tables(path), config)


def scan_dataset(
    dataset: Any,
    config: ScanConfig | None = None,
    *,
    batch_size: int = 1024,
    name: str = "dataset",
) -> ScanReport:
    """Scan a torch `Dataset` (map-style or iterable) or `DataLoader`.

    Each sample (or batch, for a DataLoader) may be a tensor, a number, or a tuple / list /
    dict of them; columns are named after that structure (``0[5]`` is element 5 of the first
    item, ``label`` a dict key). Rows are sample indices (for a DataLoader, the running count
    of samples, which matches dataset indices only without shuffling). Samples must all have
    the same shapes.
    """
    from nanguard.audit.scan_dataset import dataset_table

    return scan_tables(name, [dataset_table(dataset, batch_size, name)], config)
