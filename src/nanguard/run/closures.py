"""`optimizer.step(closure)` under `nanguard run` (LBFGS and every torch.optim optimizer): the
global step pre-hook (run/discovery.py) runs the closure once itself, before the guard's own
pre-hook, and hands the optimizer a closure whose first call returns that result. The guard
checks the gradients the closure made, and the optimizer computes exactly what it would have
(the same single call, only earlier).
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard.run.manual import ManualStep

__all__ = ["calls_closure_first", "closure_of", "run_closure_first"]


def closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The closure passed to `optimizer.step(closure)`, or None."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    return closure if callable(closure) else None


def calls_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """A torch.optim optimizer (they all call their closure first thing in `step()`)."""
    return not isinstance(optimizer, ManualStep) and type(optimizer).__module__.startswith(
        "torch.optim")


def run_closure_first(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`optimizer.step(closure)`: run the closure now (it makes the loss and the gradients the
    guard must check) and give the optimizer one whose first call returns that result, later
    calls (LBFGS line search) the real closure. Only for torch.optim's own optimizers, which
    all call the closure first thing; a custom optimizer might not call it at all."""
    if not calls_closure_first(optimizer):
        return None
    in_args = len(args) > 1 and callable(args[1])
    closure = args[1] if in_args else kwargs.get("closure")
    if not callable(closure):
        return None
    with torch.enable_grad():
        first = closure()
    calls = [0]

    def replayed() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return first
        return closure()

    if in_args:
        return (args[0], replayed, *args[2:]), kwargs
    return args, {**kwargs, "closure": replayed}

