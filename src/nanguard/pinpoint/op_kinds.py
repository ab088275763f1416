"""What the op checker (pinpoint/checker.py) knows of an op without running it: which ops make
a non-finite value on purpose, adopt memory, only move values, or assemble a batch; which
arguments an op writes in place; and where an optimizer's value belongs.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Ops whose non-finite output is made on purpose (given no python scalar +-inf).
FILL_OPS = frozenset({
    "lift_fresh", "lift_fresh_copy", "scalar_tensor", "empty", "empty_like", "new_empty",
    "empty_strided", "new_empty_strided", "empty_permuted", "resize_",
})
# Ops that adopt memory made elsewhere (a DataLoader worker's batch arrives through shared
# memory as `set_` of a storage; a file mapped in): a non-finite value they yield came with
# the data, not from a computation of this process.
ADOPT_OPS = frozenset({"set_", "from_file"})
# Ops that move values without computing: they carry a candidate on without settling it.
TRANSPORT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "expand", "detach", "alias", "select", "slice", "as_strided", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "diagonal", "clone", "_to_copy", "copy_", "copy",
    "contiguous", "lift_fresh", "view_as_real", "view_as_complex", "unfold",
})
# Ops that assemble a batch from pieces: the rows of their output are the batch's rows.
ASSEMBLE_OPS = frozenset({"stack", "cat", "index", "index_select", "_unsafe_index", "gather",
                           "take", "repeat", "flip", "roll", "constant_pad_nd"})
# Ops that make a tensor from Python values (`torch.tensor(rows)`): a NaN they hold was read.
FROM_PYTHON_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})

_mutated_cache: dict[Any, tuple[int, ...]] = {}
"""`mutated`'s answer per op overload: its schema is read once."""


def mutated(func: Any) -> tuple[int, ...]:
    """Positions of the arguments `func` writes in place (from its schema)."""
    hit = _mutated_cache.get(func)
    if hit is None:
        hit = tuple(i for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
        _mutated_cache[func] = hit
    return hit


def scalar_inf(args: Any, kwargs: Any) -> bool:
    """Whether the op was given a Python float that is +-inf or NaN (a fill on purpose)."""
    vals = [*args, *kwargs.values()]
    return any(isinstance(v, float) and not math.isfinite(v) for v in vals)


def requires_grad(args: Any) -> bool:
    """Whether a tensor argument (or one in a list argument) requires grad."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in a):
            return True
    return False


def param_of(names: dict[int, str], args: Any, outs: list[torch.Tensor],
              bad: torch.Tensor) -> str | None:
    """The parameter a non-finite optimizer value belongs to: by identity of the output or of
    an input at the same position of a foreach list."""
    if id(bad) in names:
        return names[id(bad)]
    lists = [a for a in args if isinstance(a, (list, tuple))]
    idx = next((i for lst in lists for i, x in enumerate(lst) if x is bad), None)
    if idx is None and outs:
        idx = next((i for i, x in enumerate(outs) if x is bad), None)
    if idx is not None:
        for lst in lists:
            if idx < len(lst) and isinstance(lst[idx], torch.Tensor) and id(lst[idx]) in names:
                return names[id(lst[idx])]
    for a in args:
        if isinstance(a, torch.Tensor) and id(a) in names:
            return names[id(a)]
    return None


def named_tensors(batch: Any, key: str = "") -> list[tuple[str, torch.Tensor]]:
    """The tensors of a batch (nested lists, tuples, dicts) with their keys (`[0]`, `['x']`)."""
    if isinstance(batch, torch.Tensor):
        return [(key, batch)]
    if isinstance(batch, (list, tuple)):
        return [kv for i, x in enumerate(batch) for kv in named_tensors(x, f"{key}[{i}]")]
    if isinstance(batch, dict):
        return [kv for k, x in batch.items() for kv in named_tensors(x, f"{key}[{k!r}]")]
    return []
