"""Non-finite values a failing forward held when the script died of an exception in it.

A program that checks its own activations (`if not torch.isfinite(h).all(): raise ...`), or an
error that follows a NaN (a range check, an index computed from it), ends the script inside a
module's `forward`: no loss, no backward, no step records the value, and the module's output
never exists. What does exist, once, at the end of the run: the frames of the exception's
traceback and their local variables. `nonfinite_locals` reads the tensors held by the frames of
module methods (frames whose `self` is an `nn.Module`, outside torch and nanguard): a few
reductions, never on the hot path. A shape error with only finite values in those frames finds
nothing, and the run stays the script's own error (`crashed`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

_MAX_TENSORS = 64
"""Tensors read per frame at most (a frame holding a list of thousands is not a forward's)."""


def nonfinite_locals(tb: TracebackType | None, roots: Iterable[nn.Module] = ()
                     ) -> dict[str, Any] | None:
    """The innermost module frame of `tb` whose local tensors hold NaN/Inf.

    Args:
        tb: the traceback of the exception the script died of.
        roots: the script's models (to name the module by its path in them).

    Returns:
        `{"signals": [...], "module": name, "phase": "forward", "frame": "file:line"}`, or
        None when no module frame holds a non-finite tensor.
    """
    for frame, lineno in reversed(list(_module_frames(tb))):
        names = [name for name, t in _local_tensors(frame.f_locals)
                 if (t.is_floating_point() or t.is_complex()) and not _finite(t)]
        if not names:
            continue
        module = frame.f_locals["self"]
        where = f"{frame.f_code.co_filename}:{lineno}"
        label = f"{type(module).__name__}.{frame.f_code.co_name}"
        return {"signals": [f"{', '.join(sorted(set(names)))} in {label} ({where}) when the "
                            "script raised"],
                "module": _name_of(module, roots), "phase": "forward", "frame": where}
    return None


def _module_frames(tb: TracebackType | None) -> Iterator[tuple[Any, int]]:
    skip = tuple(str(Path(m.__file__ or "").resolve().parent) for m in _packages())
    while tb is not None:
        frame = tb.tb_frame
        path = str(Path(frame.f_code.co_filename).resolve())
        if (isinstance(frame.f_locals.get("self"), nn.Module) and not path.startswith(skip)
                and not frame.f_code.co_filename.startswith("<")):
            yield frame, tb.tb_lineno
        tb = tb.tb_next


def _packages() -> tuple[Any, ...]:
    import nanguard

    return (torch, nanguard)


def _local_tensors(local: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for tensors among the locals, also inside tuples, lists and dicts one
    level down (`h, c = ...` kept as a tuple; `outputs.append(...)`)."""
    count = 0
    for name, value in local.items():
        if name == "self":
            continue
        items = value.values() if isinstance(value, dict) else (
            value if isinstance(value, (tuple, list)) else (value,))
        for item in items:
            if isinstance(item, torch.Tensor) and item.numel():
                count += 1
                if count > _MAX_TENSORS:
                    return
                yield name, item


def _finite(t: torch.Tensor) -> bool:
    try:
        with torch.no_grad():
            return bool(torch.isfinite(t.detach()).all())
    except (RuntimeError, NotImplementedError):  # sparse, meta, ...: not readable this way
        return True


def _name_of(module: nn.Module, roots: Iterable[nn.Module]) -> str | None:
    for root in roots:
        for name, m in root.named_modules():
            if m is module:
                return name
    return None
