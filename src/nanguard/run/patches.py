"""The functions `nanguard run` wraps while a script runs (run/discovery.py installs them):
`torch.Tensor.backward` (the scalar backpropagated is the loss), `clip_grad_norm_` (the
script's own clip, so a fix can speak in its terms) and `multiprocessing`'s process start
(so a run that watched nothing can say training ran in other processes).

Each `wrap_*` installs one wrapper and returns what undoes it. The wrappers hold their
callbacks weakly (`weakref.WeakMethod`: the callbacks are bound methods of the runner's
hooks object, which must not be kept alive by a torch function) and do nothing of their own
in a forked child (`run.manual.forked`: DataLoader workers, Hogwild trainers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanguard.run.manual import forked

__all__ = ["count_process_starts", "wrap_backward", "wrap_clip"]

Undo = Callable[[], None]


def wrap_backward(seen: Callable[[torch.Tensor], None]) -> Undo:
    """`Tensor.backward` calls `seen(tensor)` before it backpropagates."""
    original = torch.Tensor.backward
    hook = weakref.WeakMethod(seen)

    def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        f = hook()
        if f is not None:
            f(tensor)
        return original(tensor, *args, **kwargs)

    backward.__doc__ = original.__doc__
    torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]

    def undo() -> None:
        torch.Tensor.backward = original  # type: ignore[method-assign]

    return undo


def wrap_clip(noted: Callable[[float], None],
              clipped: Callable[[list[torch.Tensor], Any], None]) -> Undo:
    """`torch.nn.utils.clip_grad_norm_` calls `noted(max_norm)` before it clips and
    `clipped(parameters, total_norm)` after (not in a forked child)."""
    clip = torch.nn.utils.clip_grad_norm_
    before = weakref.WeakMethod(noted)
    after = weakref.WeakMethod(clipped)

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
        f, g = before(), after()
        if f is None or g is None or forked():
            return clip(parameters, max_norm, *args, **kwargs)
        f(float(max_norm))
        # A list, so that the parameters can be told apart after torch has read them (a
        # generator is read once).
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        total = clip(params, max_norm, *args, **kwargs)
        g(params, total)
        return total

    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_

    def undo() -> None:
        torch.nn.utils.clip_grad_norm_ = clip

    return undo


def count_process_starts(started: Callable[[], None]) -> Undo:
    """`multiprocessing`'s `Process.start` calls `started()` for a process that may train
    (not a DataLoader worker, not from a forked child)."""
    import multiprocessing.process as mp_process

    start = mp_process.BaseProcess.start
    hook = weakref.WeakMethod(started)

    def counted_start(proc: Any) -> None:
        f = hook()
        # A DataLoader's workers load batches, they do not train: not counted (the
        # "training inside worker processes" note would be wrong about them).
        target = getattr(getattr(proc, "_target", None), "__module__", "") or ""
        if f is not None and not forked() and not target.startswith("torch.utils.data"):
            f()
        start(proc)

    mp_process.BaseProcess.start = counted_start  # type: ignore[method-assign,assignment]

    def undo() -> None:
        mp_process.BaseProcess.start = start  # type: ignore[method-assign]

    return undo
