"""Hooks nanguard puts on the user's modules, left behind when a module is copied or pickled.

A hook registered on a module lives in the module's own `__dict__` (`_forward_hooks`,
`_load_state_dict_post_hooks`, ...), so `copy.deepcopy(model)` (an EMA or target network, a
best-model snapshot) and `torch.save(model, path)` (whole-model checkpoints, as in
pytorch/examples' word_language_model) copy the hook with the module, and with it whatever the
hook holds: a bound method of the guard's pipeline reaches the run store's SQLite connection,
which cannot be pickled, and the user's save crashed. A monitor never breaks training, and a
copy of the model is not the model the guard watches.

So every hook nanguard registers on a module is a `ModuleHook`: it calls what it wraps, and
a copy of it (deep copy, pickle) is `ignore`, a function that does nothing and returns None (so
it changes no input or output). A model pickled while watched names nanguard's `_ignore` (as a
module pickled with one of torch's own hook objects, `WeightNorm`, names torch's): it loads
wherever nanguard is importable, and with `torch.load(weights_only=True)` too, because
importing this module adds `_ignore` to torch's safe globals (a function that returns a
do-nothing function: nothing a checkpoint could misuse). Optimizer hooks need none of this:
`Optimizer.__getstate__` leaves its hooks out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ModuleHook", "ignore"]


def ignore(*_args: Any, **_kwargs: Any) -> None:
    """A copied or unpickled module's stand-in for nanguard's hook: does nothing."""
    return None


def _ignore() -> Callable[..., None]:
    """What a pickled `ModuleHook` is rebuilt by."""
    return ignore


torch.serialization.add_safe_globals([_ignore])


class ModuleHook:
    """A hook for `register_*_hook` of a user's module: calls `fn`; copies become `ignore`.

    Args:
        fn: the hook (any signature: arguments pass through, and what it returns is returned).
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return (_ignore, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return ignore
