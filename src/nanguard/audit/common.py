"""Pieces shared by the offline auditors: findings, input errors, streaming statistics,
progress bars and JSON encoding.

Nothing here imports torch, pyarrow or safetensors at module level: `nanguard scan` on a CSV
file should not pay for importing torch, and the optional extras may be missing.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

SEVERITIES = ("error", "warning", "info")


class AuditInputError(ValueError):
    """A file or argument the auditors cannot use (missing, truncated, unsafe, wrong type).

    It subclasses ValueError so that the CLI reports it as a one-line user error (exit 2).
    The message is always a single line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(one_line(message))


class UnsafeCheckpointError(AuditInputError):
    """A checkpoint that can only be loaded by executing pickled code. It is never loaded."""


@dataclass(kw_only=True)
class AuditFinding:
    """One problem an auditor found.

    Attributes:
        code: Stable machine-readable kind, e.g. ``nonfinite`` or ``NG003``.
        severity: ``error`` (numerically broken), ``warning`` (likely to break) or ``info``.
        message: One human sentence naming what and where.
        fix: The concrete change that removes the problem ("" when there is none to suggest).
        location: Where it is (a tensor name, ``row 137, column 'x'``, ``file:line:col``).
        details: Extra machine-readable facts (counts, values, row numbers).
    """

    code: str
    severity: str
    message: str
    fix: str = ""
    location: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        assert self.severity in SEVERITIES, self.severity

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity,
            "message": self.message,
            "fix": self.fix,
            "location": self.location,
            "details": json_safe(self.details),
        }


def one_line(text: object) -> str:
    """Collapse an exception message (often multi-line in torch and pyarrow) to one line."""
    parts = [p.strip() for p in str(text).splitlines() if p.strip()]
    line = " ".join(parts) or "unknown error"
    return line if len(line) <= 300 else line[:297] + "..."


def require(module: str, extra: str) -> ModuleType:
    """Import an optional dependency, or raise a one-line error naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise AuditInputError(
            f"this needs the optional package '{module.split('.')[0]}': "
            f"pip install nanguard[{extra}]"
        ) from None


def json_safe(obj: Any) -> Any:
    """Make `obj` strict-JSON serialisable: NaN and infinities become strings, numpy scalars
    become Python numbers, tuples become lists."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        # Strings, not null: a reader must be able to tell NaN from "not computed".
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    return obj


def fmt_num(value: float | None) -> str:
    """Short human form of a number for tables."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    if isinstance(value, int) or float(value).is_integer() and abs(value) < 1e6:
        return f"{int(value)}"
    return f"{value:.4g}"


def robust_z(values: np.ndarray) -> np.ndarray:
    """Robust z-scores (median and scaled MAD). A zero MAD gives 0 for the median and inf
    for anything else, so callers should also demand an absolute effect size."""
    med = np.median(values)
    mad = 1.4826 * np.median(np.abs(values - med))
    dev = values - med
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(dev == 0, 0.0, dev / mad if mad > 0 else np.sign(dev) * np.inf)
    return np.asarray(z, dtype=np.float64)


class RunningMoments:
    """Per-column count, mean, M2, min and max over finite values, merged chunk by chunk with
    Chan et al.'s parallel update, so a file of any length needs memory for one chunk only."""

    def __init__(self, ncols: int) -> None:
        self.count = np.zeros(ncols, dtype=np.int64)
        self.mean = np.zeros(ncols, dtype=np.float64)
        self.m2 = np.zeros(ncols, dtype=np.float64)
        self.min = np.full(ncols, np.inf)
        self.max = np.full(ncols, -np.inf)

    def update(self, chunk: np.ndarray, finite: np.ndarray) -> None:
        """Fold in a (rows, ncols) float64 chunk; `finite` masks the values to count."""
        n_b = finite.sum(axis=0)
        if not n_b.any():
            return
        vals = np.where(finite, chunk, 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            mean_b = np.where(n_b > 0, vals.sum(axis=0) / np.maximum(n_b, 1), 0.0)
            m2_b = (np.where(finite, chunk - mean_b, 0.0) ** 2).sum(axis=0)
        self.min = np.minimum(self.min, np.where(finite, chunk, np.inf).min(axis=0))
        self.max = np.maximum(self.max, np.where(finite, chunk, -np.inf).max(axis=0))
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        safe_n = np.maximum(n, 1)
        self.mean = self.mean + delta * (n_b / safe_n)
        self.m2 = self.m2 + m2_b + delta**2 * (n_a * n_b / safe_n)
        self.count = n

    @property
    def std(self) -> np.ndarray:
        """Population standard deviation (what a normaliser computed on this data would use)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.count > 0, np.sqrt(self.m2 / np.maximum(self.count, 1)), np.nan)


class _Progress:
    """A progress bar on stderr, or a no-op when stderr is not a terminal (pipes, tests)."""

    def __init__(self, total: float | None, description: str) -> None:
        self._bar: Any = None
        self._task: Any = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self._bar = Progress(console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(description, total=total)

    def advance(self, amount: float) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def update(self, completed: float) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@contextmanager
def progress(total: float | None, description: str) -> Iterator[_Progress]:
    """Context manager yielding a progress bar with `advance` and `update`."""
    bar = _Progress(total, description)
    try:
        yield bar
    finally:
        bar.close()


class FieldsToDict:
    """Mixin for flat result dataclasses: `to_dict()` is every field, made strict-JSON safe."""

    def to_dict(self) -> dict[str, Any]:
        fields = self.__dataclass_fields__  # type: ignore[attr-defined]
        return json_safe({k: getattr(self, k) for k in fields})
