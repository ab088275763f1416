"""Where a value entered already non-finite: a tensor made from Python or NumPy numbers that
overflowed on its way into a narrower dtype.

`torch.tensor(returns)` of Python floats beyond float32's largest value holds inf, and no op
computed it: the dispatcher sees only `lift_fresh` of a tensor that is already inf, which the
checker otherwise takes for an inf written on purpose (a mask built from a list). While a
checker is active, `torch.tensor` and `torch.as_tensor` are wrapped: when the checker saw the
tensor they return come out non-finite (`NonfiniteChecker.fresh`, one identity compare per
call otherwise), the data they were given is read again in float64. Finite there, the value
was made by the narrowing: the checker opens a candidate at that line (`entered`: how
`tensor`, with the data's float64 range as the op's input), instead of the later op that
first turned the inf into NaN. Data that held inf itself stays a value made on purpose.

Only while a checker runs (a replay, the armed re-run), never on the training's hot path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import _disable_current_modes

from nanguard.pinpoint.attribution import user_source
from nanguard.pinpoint.origin import InputRange, input_ranges


class _Receiver(Protocol):
    def fresh(self, t: torch.Tensor) -> bool: ...

    def entered(self, t: torch.Tensor, *, how: str, source: str | None,
                data: InputRange) -> None: ...


_active: list[_Receiver] = []
_saved: dict[str, Callable[..., Any]] = {}
_NAMES = ("tensor", "as_tensor")


def install(receiver: _Receiver) -> None:
    """Wrap `torch.tensor` / `torch.as_tensor` for `receiver` (nests: the innermost gets it)."""
    _active.append(receiver)
    if len(_active) == 1:
        for name in _NAMES:
            original = getattr(torch, name)
            _saved[name] = original
            setattr(torch, name, _wrapped(original))


def uninstall(receiver: _Receiver) -> None:
    """Undo `install(receiver)`; the originals come back when no receiver is left."""
    if receiver in _active:
        _active.remove(receiver)
    if not _active:
        for name, original in _saved.items():
            setattr(torch, name, original)
        _saved.clear()


def _wrapped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def make(data: Any, *args: Any, **kwargs: Any) -> Any:
        t = original(data, *args, **kwargs)
        try:
            if _active and isinstance(t, torch.Tensor) and _active[-1].fresh(t):
                _narrowed(_active[-1], t, data)
        except Exception:  # noqa: BLE001 - a monitor never breaks training (fail open)
            pass
        return t

    return make


def _narrowed(receiver: _Receiver, t: torch.Tensor, data: Any) -> None:
    """`t` came out non-finite: read `data` in float64; finite there, the narrowing made it."""
    with _disable_current_modes(), torch.no_grad():
        wide = data.detach().double() if isinstance(data, torch.Tensor) else (
            _saved.get("as_tensor", torch.as_tensor)(data, dtype=torch.float64))
        if wide.numel() == 0 or not bool(torch.isfinite(wide).all()):
            return  # the data held inf / NaN itself: made on purpose, or read as such
        data_range = input_ranges([wide])[0]
    how = "numpy" if type(data).__module__ == "numpy" else "tensor"
    receiver.entered(t, how=how, source=user_source(), data=data_range)


_TARGET_ARGS = frozenset({"target"})
"""Schema names of a loss's label argument (`mse_loss(self, target)`, `binary_cross_entropy
(self, target, ...)`, `smooth_l1_loss`, `huber_loss`, `kl_div`, ...)."""


def follow(checker: Any, func: Any, args: Any, kwargs: dict[str, Any], out: Any) -> None:
    """After a batch value was settled as the origin (`kind` input) and before it is placed:
    carry its label on through the ops that read it, until it reaches a model's forward
    (the checker's `_batch_rows`: a model input) or a loss's `target` argument (a label:
    `entered` how `target`, at the loss's line). Only while the checker is otherwise
    passing ops through; one identity lookup per tensor argument."""
    origin = checker.origin
    k = checker.candidates.index_of(origin)
    if k is None:
        return
    try:
        names = [a.name for a in func._schema.arguments]
    except AttributeError:
        names = []
    hit = False
    pairs = [(names[i] if i < len(names) else "", v) for i, v in enumerate(args)]
    for name, value in pairs + list(kwargs.items()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and checker.candidates.label(t) == k:
                if name in _TARGET_ARGS:
                    origin.entered = {"how": "target", "source": user_source(),
                                      "op": f"aten.{func.overloadpacket.__name__}"}
                    return
                hit = True
    if hit:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                checker.candidates.taint(t, k)


def place(origin: Any, tensors: list[torch.Tensor]) -> None:
    """At the end of the step, for a batch value: the data file it was read from, when the
    tensor holding it came out of `torch.load` (`watch.loads.file_of`), else the one data file
    the script read with NumPy, if only one (`watch.loads.data_files`)."""
    from nanguard.watch import loads

    path = next((p for t in tensors if (p := loads.file_of(t)) is not None), None)
    read = "torch.load"
    if path is None:
        files = loads.data_files()
        path, read = (files[0], "numpy") if len(files) == 1 else (None, "")
    if path is None:
        return
    origin.entered = {**(origin.entered or {"how": "data_file"}), "file": path, "read": read}
