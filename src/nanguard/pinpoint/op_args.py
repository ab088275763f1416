"""The non-tensor arguments of the origin op: what its tensor inputs alone do not say.

A Python scalar divisor (`x / (n - 1)` with n == 1), the `correction` of a `std` / `var`,
the `dim` a reduction runs over, the `dtype` of a cast or of a tensor made from Python
numbers, a `pow` exponent: the diagnosis reads them to name the mechanism (shared/DESIGN.md
section 10, "Causes from what an op is"). Computed for the one reported op only, never per op.
"""

from __future__ import annotations

import math
from typing import Any

import torch

_MAX_LIST = 16
"""Longer lists (a shape, a long `dim` list) are cut: the diagnosis needs no more."""


def op_args(func: Any, args: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's non-tensor arguments by their schema names (positional and keyword), as
    JSON-safe values: numbers (a non-finite float as the string "inf" / "-inf" / "nan"),
    bools, None, strings, dtypes (`"float32"`), and lists of those. Tensors and lists of
    tensors are left out (they are `inputs`); so are devices, layouts and memory formats.
    Arguments left at their defaults are absent: the reader knows the op's defaults."""
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:  # not an OpOverload: no schema to name the arguments by
        names = []
    out: dict[str, Any] = {}
    items = [(names[i] if i < len(names) else f"arg{i}", v) for i, v in enumerate(args)]
    items += list(kwargs.items())
    for name, value in items:
        safe = _safe(value)
        if safe is not _SKIP:
            out[name] = safe
    return out


_SKIP = object()


def _safe(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return _SKIP
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, (list, tuple)):
        if any(isinstance(x, torch.Tensor) for x in v):
            return _SKIP
        items = [_safe(x) for x in v[:_MAX_LIST]]
        return _SKIP if any(x is _SKIP for x in items) else items
    return _SKIP  # devices, layouts, memory formats, generators
