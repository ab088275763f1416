"""L2 norms of many tensors on their device, in as few kernels as the device allows.

`foreach_norms` is the one entry point: float32 `_foreach_norm` for the common dense
fp16/bf16/fp32 case (one fused kernel on CUDA), float64 and complex tensors in their own
precision, sparse tensors by their stored values, DTensor shards combined across ranks.
`NormPlan` covers the CPU case where `_foreach_norm` is a loop of one small kernel per tensor:
hundreds of small parameters (100 blocks of Linear(32, 32) + LayerNorm) are stacked by shape
and reduced with one kernel per shape instead (about 3x less time at 400 tensors).
"""

from __future__ import annotations

import operator
import sys
from itertools import repeat
from typing import Any

import torch

_MODULES = sys.modules
_DT_MODULE = "torch.distributed.tensor"


def dtensor_type() -> type | None:
    """`DTensor` (sharded parameters: FSDP2, tensor parallel) once something imported it, else
    None. Not imported here: it costs ~0.5 s of CPU in every process that imports nanguard, and
    a DTensor cannot exist before its module is imported. (The hot paths inline this lookup.)"""
    mod = _MODULES.get(_DT_MODULE)
    return None if mod is None else getattr(mod, "DTensor", None)


def is_dtensor(t: Any) -> bool:
    mod = _MODULES.get(_DT_MODULE)
    return mod is not None and isinstance(t, mod.DTensor)

def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


_F32_NORM = (torch.float32, torch.float16, torch.bfloat16)
F32_SET = frozenset(_F32_NORM)
"""Dtypes whose norms `_foreach_norm` computes in float32 (the common dense case)."""
STRIDED = frozenset((torch.strided,))
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")


def dense_values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's stored values as a dense real float64 tensor (sparse: its values; complex: its
    magnitudes), for the rare exact checks on the host."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.coalesce().values()
    return (t.abs() if t.is_complex() else t).double()


def _plain_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stacked float64 L2 norms of local tensors of any dtype and layout.

    The common case (dense float16 / bfloat16 / float32 tensors) is one fused `_foreach_norm`
    computed in float32 (an fp16 norm above 65504 would read as inf). Float64 and complex
    tensors are reduced in their own precision (a float32 norm cannot be asked of them), sparse
    gradients (`nn.Embedding(sparse=True)`) by the norm of their stored values: every dtype and
    layout PyTorch trains in is measured.
    """
    if all(t.layout == torch.strided and t.dtype in _F32_NORM for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).double()
    groups: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        key = "sparse" if t.layout != torch.strided else t.dtype
        groups.setdefault(key, []).append(i)
    device = tensors[0].device
    out = torch.empty(len(tensors), dtype=torch.float64, device=device)
    for key, ids in groups.items():
        if key == "sparse":
            # Uncoalesced values may repeat an index; their norm still tells finite from not.
            vals = [tensors[i].coalesce().values() for i in ids]
            norms = [torch.linalg.vector_norm(v.double() if not v.is_complex() else v)
                     for v in vals]
        elif key in _F32_NORM:
            norms = list(torch._foreach_norm([tensors[i] for i in ids], 2, dtype=torch.float32))
        else:  # float64, complex: their own precision; complex norms are real
            norms = list(torch._foreach_norm([tensors[i] for i in ids], 2))
        out[ids] = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
    return out


Norms = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]
"""Per-tensor norms on the device: one float64 tensor, or a list of 0-dim norms (a `Packet`
slot takes either)."""


def norm_values(tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None) -> Norms:
    """`foreach_norms`, with the common case (dense float16 / bfloat16 / float32 local
    tensors) left as `_foreach_norm`'s own 0-dim float32 norms: no stack and no float64
    conversion of their own (the step's packet stacks all its 0-dim values at once)."""
    # Checked in C (`map`, sets): a generator here was one Python call per tensor and step.
    if (set(map(_LAYOUT, tensors)) <= STRIDED and set(map(_DTYPE, tensors)) <= F32_SET
            and ((dt := _MODULES.get(_DT_MODULE)) is None
                 or not any(map(isinstance, like or tensors, repeat(dt.DTensor))))):
        return torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return foreach_norms(tensors, like=like)


def foreach_norms(tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None
                  ) -> torch.Tensor:
    """Stacked L2 norms of `tensors` (fused), on their device, as float64.

    DTensors (FSDP2, tensor parallel): the norms of the local shards, combined into the norm of
    the whole tensor by one sum-of-squares all-reduce per group of sharded mesh dimensions
    (usually one collective per call); replicated dimensions need none. `like` gives, for plain
    local tensors (e.g. local update differences), the DTensors whose sharding they follow.
    Every rank must call this with the same tensors, as it does for gradients, parameters and
    optimizer state of one optimizer.
    """
    specs = like if like is not None else tensors
    dt = dtensor_type()
    if dt is None or not any(isinstance(t, dt) for t in specs):
        return _plain_norms(tensors)
    dts: list[Any] = [t if is_dtensor(t) else None for t in specs]
    norms = _plain_norms([local(t) for t in tensors])
    groups: dict[tuple[int, tuple[int, ...]], tuple[Any, list[int]]] = {}
    for i, d in enumerate(dts):
        if d is None:
            continue
        dims = tuple(k for k, p in enumerate(d.placements) if p.is_shard())
        if dims:
            groups.setdefault((id(d.device_mesh), dims), (d.device_mesh, []))[1].append(i)
    if not groups:
        return norms
    import torch.distributed as dist

    squares = norms.pow(2)
    for (_, dims), (mesh, ids) in groups.items():
        part = squares[ids]
        for k in dims:
            dist.all_reduce(part, group=mesh.get_group(k))
        squares[ids] = part
    return squares.sqrt()




def _one(i: int) -> Any:
    """`itemgetter(i)`, as a 1-tuple (what `itemgetter` of several indices gives)."""
    get = operator.itemgetter(i)
    return lambda seq: (get(seq),)


class NormPlan:
    """Per-tensor norms of a fixed list of many small CPU tensors, one kernel per shape.

    Built from the tensors it will measure (the parameters, or every tensor the post-update
    pass measures: parameters, optimizer state, buffers); measures any list aligned with them
    (their gradients, the update buffers): tensors of one shape are stacked (a copy the size
    of the group: the reason it is kept for small tensors) and reduced together in float32, as
    `_foreach_norm` does (the same values: each row is reduced on its own).

    Args:
        tensors: the tensors the plan is aligned with.
    """

    MIN_TENSORS = 16
    """Below this many tensors `_foreach_norm`'s loop is as cheap."""
    PER_GROUP = 6
    """A plan pays when it has at least this many tensors per shape group (plus a few): on the
    CPU each of `_foreach_norm`'s per-tensor kernels costs ~1.1 us, and each group a stack and
    a reduction, ~5 us (the small GPT of benchmarks/spiky_lm.py, 9 shapes: its 29 gradients take
    33 us by `_foreach_norm`, 55 us by a plan; its 87 parameters and Adam moments 96 us by
    `_foreach_norm`, 65 us by one plan)."""
    MAX_MEAN_NUMEL = 1 << 13
    """Above this mean size the stacking copy costs more than the per-tensor kernels save
    (64 float32 tensors, one thread: the plan takes 0.3x `_foreach_norm`'s time at 1024
    elements each, 0.7x at 4096, 1.4x at 16384, 2.0x at 65536)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, p in enumerate(tensors):
            groups.setdefault((tuple(p.shape), p.dtype), []).append(i)
        self.groups = list(groups.values())
        # Each group's tensors picked in C (`itemgetter`; a 1-tuple for a group of one), not
        # by a comprehension per group and step.
        getter: Any = operator.itemgetter
        self._pick = [getter(*ids) if len(ids) > 1 else _one(ids[0]) for ids in self.groups]
        self.order = [i for ids in self.groups for i in ids]
        """Tensor indices in the order `grouped` gives their norms."""
        self._inverse: torch.Tensor | None = None
        self.size = len(tensors)

    @classmethod
    def worth(cls, tensors: list[torch.Tensor]) -> bool:
        """Whether a plan pays off: many small dense CPU tensors of float32-norm dtypes, in
        few shapes (`PER_GROUP`)."""
        if len(tensors) < cls.MIN_TENSORS:
            return False
        if sum(p.numel() for p in tensors) > cls.MAX_MEAN_NUMEL * len(tensors):
            return False
        shapes = len({(tuple(p.shape), p.dtype) for p in tensors})
        if len(tensors) < cls.PER_GROUP * shapes + 4:
            return False
        dt = dtensor_type()
        return all(type(p) is not dt and p.device.type == "cpu"
                   and p.layout == torch.strided and p.dtype in _F32_NORM for p in tensors)

    def grouped(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """Float32 norms of `tensors` (aligned with the plan) in the plan's group order
        (`order`: the host puts them back in place, no gather on the device), or None when they
        no longer fit it (a shape, dtype or layout changed): the caller falls back to
        `foreach_norms`."""
        if len(tensors) != self.size:
            return None
        parts = []
        try:
            for ids, pick in zip(self.groups, self._pick, strict=True):
                x = torch.stack(pick(tensors))
                if x.dtype not in _F32_NORM or x.layout != torch.strided:
                    return None
                parts.append(torch.linalg.vector_norm(x.reshape(len(ids), -1), dim=1,
                                                      dtype=torch.float32))
        except RuntimeError:  # shapes differ within a group (a parameter was resized)
            return None
        return torch.cat(parts)

    def norms(self, tensors: list[torch.Tensor]) -> torch.Tensor | None:
        """Float64 norms of `tensors` (aligned with the plan) in their own order, or None when
        they no longer fit it (see `grouped`)."""
        out = self.grouped(tensors)
        if out is None:
            return None
        if self._inverse is None:  # made on first use: a post-update plan never needs it
            self._inverse = torch.empty(len(self.order), dtype=torch.long)
            self._inverse[self.order] = torch.arange(len(self.order))
        return out.double()[self._inverse]
