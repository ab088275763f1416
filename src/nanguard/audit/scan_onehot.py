"""One-hot column groups: given by prefix (strict), or found by name and content (lenient).

A found group is a set of >= 2 columns sharing a name prefix (``color_red``, ``color_blue``,
or ``y[0]``, ``y[1]`` for a 2-D array) whose values are all 0 or 1. It is only judged when
at least 90% of its rows hold exactly one 1: then rows with two or more 1s are broken, and
so are all-zero rows if they are rare (<= 0.5% of rows; a dummy encoding that drops one
category has many all-zero rows, and they are fine). Independent binary flags that share a
prefix rarely sum to exactly one, so they are not mistaken for a group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from nanguard.audit.common import AuditFinding, AuditInputError

MAX_ROWS = 10
AUTO_MIN_ONE_FRACTION = 0.9
AUTO_MAX_ZERO_FRACTION = 0.005


def split_prefix(name: str) -> str | None:
    """The group prefix of a column name: ``color_red`` -> ``color``, ``y[3]`` -> ``y``."""
    if "[" in name:
        return name.split("[", 1)[0]
    match = re.match(r"^(.+)[_.:=][^_.:=]+$", name)
    return match.group(1) if match else None


@dataclass(kw_only=True)
class OneHotGroup:
    prefix: str
    index: list[int]
    strict: bool
    binary: bool = True  # every finite value seen so far is 0 or 1
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("bad", "zero", "one", "many"), 0)
    )
    rows: dict[str, list[tuple[int, float]]] = field(
        default_factory=lambda: {"bad": [], "zero": [], "many": []}
    )

    def feed(self, values: np.ndarray, start: int) -> None:
        sub = values[:, self.index]
        is01 = (sub == 0) | (sub == 1)
        if self.binary and not (is01 | ~np.isfinite(sub)).all():
            self.binary = False
        if not self.strict and not self.binary:
            return  # not a one-hot group after all; stop paying for it
        row01 = is01.all(axis=1)
        sums = sub.sum(axis=1)
        masks = {
            "bad": ~row01,
            "zero": row01 & (sums == 0),
            "one": row01 & (sums == 1),
            "many": row01 & (sums >= 2),
        }
        for kind, mask in masks.items():
            n = int(mask.sum())
            self.counts[kind] += n
            if n and kind != "one" and len(self.rows[kind]) < MAX_ROWS:
                idx = np.flatnonzero(mask)[: MAX_ROWS - len(self.rows[kind])]
                self.rows[kind].extend((start + int(i), float(sums[i])) for i in idx)

    def finding(self, nrows: int) -> AuditFinding | None:
        c = self.counts
        if self.strict:
            kinds = ["bad", "zero", "many"]
        else:
            if not self.binary or nrows == 0 or c["one"] < AUTO_MIN_ONE_FRACTION * nrows:
                return None
            kinds = ["many"] + (["zero"] if c["zero"] <= AUTO_MAX_ZERO_FRACTION * nrows else [])
        n = sum(c[k] for k in kinds)
        if not n:
            return None
        rows = sorted(r for k in kinds for r in self.rows[k])[:MAX_ROWS]
        shown = ", ".join(f"{r} (sum {s:g})" for r, s in rows)
        how = "" if self.strict else f" ({c['one'] / nrows:.1%} of rows hold exactly one 1)"
        return AuditFinding(
            code="onehot",
            severity="error" if self.strict else "warning",
            location=f"row {rows[0][0]}, columns {self.prefix}*",
            message=f"one-hot group {self.prefix!r} ({len(self.index)} columns){how}: {n} "
            f"row{'s' if n > 1 else ''} without exactly one 1, at rows {shown}"
            f"{', ...' if n > len(rows) else ''}",
            fix="re-encode these rows; a row with no or several 1s is a different input "
            "than any category the model was meant to see",
            details={
                "prefix": self.prefix,
                "columns": self.index,
                "count": n,
                "rows": [r for r, _ in rows],
            },
        )


def explicit_groups(
    columns: list[str], prefixes: Sequence[str], ignored: set[str]
) -> list[OneHotGroup]:
    groups = []
    for prefix in prefixes:
        index = [i for i, c in enumerate(columns) if c.startswith(prefix) and c not in ignored]
        if not index:
            raise AuditInputError(f"--onehot {prefix!r}: no column name starts with it")
        groups.append(OneHotGroup(prefix=prefix, index=index, strict=True))
    return groups


def candidate_groups(columns: list[str], ignored: set[str], taken: set[int]) -> list[OneHotGroup]:
    by_prefix: dict[str, list[int]] = {}
    for i, name in enumerate(columns):
        prefix = split_prefix(name)
        if prefix and name not in ignored and i not in taken:
            by_prefix.setdefault(prefix, []).append(i)
    return [
        OneHotGroup(prefix=p, index=idx, strict=False)
        for p, idx in by_prefix.items()
        if len(idx) >= 2
    ]
