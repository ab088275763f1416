"""The in-process replay of an `optimizer.step(closure)` step (LBFGS, or any torch.optim
optimizer given a closure): the closure is called again, under the op checker, from the RNG
and autocast states its first call started with; it runs forward, loss and backward itself,
so the checker labels its ops by what they are. What the closure changes in the script's
Python state (the variables it closes over, the globals it names) is put back afterwards, and
its prints are dropped: replaying it must not change what the script sees.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any

import torch

from nanguard.pinpoint.recipe import NotReplayable, autocast_as
from nanguard.watch import rng


class _KeptCells:
    """The closure's variables as they were before a replay of it, put back afterwards: the
    ones it closes over and the globals its code names (a `global calls; calls += 1` counter,
    a list of losses it appends to, rebound or changed in place, one level deep). Replaying
    the closure must not change what the script sees. Python state reached otherwise
    (attributes of objects, the contents of nested containers) is not restored."""

    def __init__(self, fn: Any) -> None:
        self.saved: list[tuple[Any, Any, Any]] = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.saved.append((cell, value, _shallow(value)))
        self.globals: list[tuple[str, Any, Any]] = []
        self.scope: dict[str, Any] = {}
        scope = getattr(fn, "__globals__", None)
        code = getattr(fn, "__code__", None)
        if isinstance(scope, dict) and code is not None:
            self.scope = scope
            self.globals = [(n, scope[n], _shallow(scope[n])) for n in code.co_names
                            if n in scope]

    def restore(self) -> None:
        for name, value, copy in self.globals:
            if self.scope.get(name) is not value:
                self.scope[name] = value
            _put_back(value, copy)
        for cell, value, copy in self.saved:
            cell.cell_contents = value
            _put_back(value, copy)


def _shallow(value: Any) -> Any:
    return list(value) if isinstance(value, list) else (
        dict(value) if isinstance(value, dict) else None)


def _put_back(value: Any, copy: Any) -> None:
    """`value` (a list or dict) back to its shallow `copy` if it changed."""
    if isinstance(value, list) and copy is not None and (
            len(value) != len(copy) or any(a is not b for a, b in zip(value, copy, strict=True))):
        value[:] = copy
    elif isinstance(value, dict) and copy is not None and (
            value.keys() != copy.keys() or any(value[k] is not copy[k] for k in copy)):
        value.clear()
        value.update(copy)


@dataclass(eq=False)
class ClosureRecipe:
    """How to compute one `optimizer.step(closure)` step's loss again: call the closure (it runs
    forward, loss and backward itself), from the RNG and autocast states its first call started
    with. The runner calls that first call itself before the guard checks the step
    (run/discovery.py), so the parameters are still those it saw."""

    closure: Any
    rng: dict[str, Any]
    amp: tuple[tuple[str, torch.dtype], ...]
    batch: Any = None
    """The batch the guard was handed for this step (set by the runner)."""

    def matches(self, batch: Any) -> bool:
        """`batch` is the step's own (a single sample of it is not: the closure takes none)."""
        if batch is None or self.batch is None:
            return batch is None and self.batch is None
        a = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        b = tuple(self.batch) if isinstance(self.batch, (tuple, list)) else (self.batch,)
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

    def run(self) -> torch.Tensor:
        """The closure again; its loss is marked as already backpropagated.

        Raises:
            NotReplayable: torch.distributed is initialized, or the closure returned no tensor.
        """
        from nanguard.pinpoint.inprocess import mark_backpropagated

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise NotReplayable("torch.distributed: a replayed backward would wait for the "
                                "other ranks")
        kept = _KeptCells(self.closure)
        rng.restore(self.rng)
        try:
            # The closure's prints (a loss log) are the replay's, not the script's: dropped.
            with autocast_as(self.amp), contextlib.redirect_stdout(io.StringIO()):
                out = self.closure()
        finally:
            kept.restore()
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise NotReplayable("the closure returned no loss tensor")
        mark_backpropagated(out)
        return out


