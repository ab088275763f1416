"""The finding of a pinpoint run: where the first non-finite value came from.

`Origin.to_dict()` gives the `first_nonfinite` keys of report.json (`step`, `phase`, `module`,
`op`, `source`, `samples`, `rank`) plus the evidence a diagnosis step reads (`param`,
`reproduced`, `inputs`, `kind`, `node`, `output`, `propagated_by`, `batch_item`, `args`).

The tensor helpers here run on the host only for the one op that is reported, never per op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

PHASES = ("data", "forward", "loss", "backward", "optimizer")


@dataclass(kw_only=True)
class InputRange:
    """The range of one floating input of the origin op: evidence for a diagnosis."""

    index: int
    """Position among the op's tensor inputs (lists flattened in order)."""
    shape: list[int]
    dtype: str
    min: float | None
    """Smallest value (None for an empty tensor); may be -inf for an intended mask."""
    max: float | None
    has_zero: bool
    has_negative: bool
    nonfinite: bool
    """The input already held a non-finite value (an intended mask, or a propagated value)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "shape": self.shape, "dtype": self.dtype,
            "min": _safe(self.min), "max": _safe(self.max), "has_zero": self.has_zero,
            "has_negative": self.has_negative, "nonfinite": self.nonfinite,
        }


@dataclass(kw_only=True)
class Origin:
    """The first op that produced a non-finite value from finite inputs, and where it ran."""

    step: int | None = None
    """0-based training step (optimizer steps completed before it); None when unknown."""
    phase: str | None
    """One of `data`, `forward`, `loss`, `backward`, `optimizer` (None: nothing reproduced)."""
    module: str | None = None
    """Name from `model.named_modules()` ("" is the root); None outside every module. In
    backward, the module whose forward created the autograd node; in the optimizer, the module
    owning the parameter."""
    op: str | None = None
    """Aten overload packet, e.g. `aten._softmax`. For `data`, the first op that consumed it."""
    source: str | None = None
    """`path:line` of the innermost user frame (outside torch and nanguard) when the op ran; for
    backward, the forward-time line that created the autograd node."""
    samples: list[int] = field(default_factory=list)
    """Batch rows that carry the value (rows of the op output along the batch dimension)."""
    rank: int = 0
    param: str | None = None
    """For optimizer ops: the parameter's name when it can be identified."""
    reproduced: bool | None = None
    """Replay only: the replay ended bit for bit like the original run (False: suspect
    non-determinism); None when no fingerprint was given."""
    inputs: list[InputRange] = field(default_factory=list)
    kind: str = "op"
    """`op` (produced by an op), `input` (the batch held it), `state` (a parameter, buffer or
    optimizer state already held it), `none` (a replay that did not fail)."""
    node: str | None = None
    """In backward: the autograd node that ran the op, e.g. `SqrtBackward0`."""
    output: dict[str, Any] = field(default_factory=dict)
    """`shape`, `dtype`, `nan`, `inf` of the non-finite output."""
    propagated_by: dict[str, Any] | None = None
    """The first later op whose output carried the value on (`op`, `phase`, `module`): what a
    tool that reports the first non-finite output, not its origin, would name."""
    batch_item: str | None = None
    """For `data`: which element of the batch held it, e.g. `[0]` or `['y']`."""
    dataset_rows: list[int] | None = None
    """For `data` met before the batch existed (a collate function stacking rows of a whole
    data set): the rows of that tensor; `samples` are the rows of the batch."""
    entered: dict[str, Any] | None = None
    """Where a value that entered already non-finite came in: `how` (`tensor`, `numpy`:
    made from those numbers; `data_file`; `checkpoint`; `target`) and `source`."""
    args: dict[str, Any] = field(default_factory=dict)
    """The op's non-tensor arguments by schema name (`pinpoint.op_args`): a Python scalar
    divisor (`other`), `correction`, `dim`, the `dtype` of a cast or tensor creation."""

    def to_dict(self) -> dict[str, Any]:
        """The report.json `first_nonfinite` entry (JSON-safe: no NaN/Inf floats)."""
        return {
            "step": self.step, "phase": self.phase, "module": self.module, "op": self.op,
            "source": self.source, "samples": list(self.samples), "rank": self.rank,
            "param": self.param, "reproduced": self.reproduced,
            "inputs": [i.to_dict() for i in self.inputs], "kind": self.kind, "node": self.node,
            "output": dict(self.output), "propagated_by": self.propagated_by,
            "batch_item": self.batch_item, "dataset_rows": self.dataset_rows,
            "args": dict(self.args), "entered": self.entered,
        }


def _safe(x: float | None) -> float | str | None:
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Floating/complex tensors in `obj` (a tensor, or a list/tuple of them), deduplicated."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    items = obj if isinstance(obj, (list, tuple)) else (obj,)
    for x in items:
        if isinstance(x, (list, tuple)):
            for y in x:
                if _is_float(y) and id(y) not in seen:
                    seen.add(id(y))
                    out.append(y)
        elif _is_float(x) and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _is_float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor is finite. One reduction and one host read per tensor.

    A finite sum proves every element finite (NaN and Inf both poison a sum); a non-finite sum
    may be an overflow of finite values, so only then is the exact check made.
    """
    for t in tensors:
        if t.numel() == 0 or t.is_meta:
            continue
        s = t.detach().sum()
        if s.is_complex():
            s = s.real + s.imag
        if math.isfinite(float(s)):
            continue
        if not bool(torch.isfinite(t).all()):
            return False
    return True


def has_nan(tensors: list[torch.Tensor]) -> bool:
    return any(t.numel() and bool(torch.isnan(t).any()) for t in tensors)


def nonfinite_rows(t: torch.Tensor, batch_size: int | None) -> list[int]:
    """Indices along the batch dimension (dim 0, else the first dim of that size) that hold a
    non-finite value; [] when no dimension matches the batch size."""
    if t.dim() == 0 or not batch_size:
        return []
    dims = [d for d, n in enumerate(t.shape) if n == batch_size]
    if not dims:
        return []
    bad = ~torch.isfinite(t.detach().movedim(dims[0], 0))
    rows: list[int] = bad.reshape(batch_size, -1).any(1).nonzero().flatten().tolist()
    return rows


def input_ranges(tensors: list[torch.Tensor]) -> list[InputRange]:
    """`InputRange` for each tensor (computed for the reported op only)."""
    out = []
    for i, t in enumerate(tensors):
        d = t.detach()
        if d.is_complex():
            d = d.abs()
        if d.numel() == 0:
            lo = hi = None
            zero = neg = nonfinite = False
        else:
            fin = torch.isfinite(d)
            nonfinite = not bool(fin.all())
            dd = d.double()
            lo, hi = float(dd.min()), float(dd.max())
            zero = bool((d == 0).any())
            neg = bool((d < 0).any())
        out.append(InputRange(index=i, shape=list(t.shape), dtype=str(t.dtype).replace(
            "torch.", ""), min=lo, max=hi, has_zero=zero, has_negative=neg, nonfinite=nonfinite))
    return out


def output_summary(t: torch.Tensor) -> dict[str, Any]:
    d = t.detach()
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
            "nan": bool(torch.isnan(d).any()), "inf": bool(torch.isinf(d).any())}
