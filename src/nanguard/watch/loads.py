"""Where state was loaded from: the user's line that called `load_state_dict` / `torch.load`.

A value that is non-finite before the first update was not produced by training: it came
with loaded state (a checkpoint's weights, optimizer state or buffers). The report then names
the tensor and the line that loaded it. The guard learns the line two ways:

* its own `load_state_dict` post-hooks on the model and optimizer (state loaded after the
  guard was created, e.g. a resume in the middle of a script);
* `track()`, installed by `nanguard run` for the whole script (state loaded before any guard
  exists): it wraps `torch.load`, `nn.Module.load_state_dict` and
  `Optimizer.load_state_dict` to remember the last call site. Removed by `untrack()`.

Nothing here reads a device value.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch

_OWN = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
_last: str | None = None
_patched: list[tuple[Any, str, Any]] = []


def call_site() -> str | None:
    """`file:line` of the innermost frame outside torch and nanguard (the user's call)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_OWN) and not name.startswith("<frozen"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def note(site: str | None) -> None:
    """Remember `site` as the last place state was loaded."""
    global _last
    if site is not None:
        _last = site


def last_site() -> str | None:
    """The last load call site seen by `track()` or a guard's hooks (None if none)."""
    return _last


def _wrap(owner: Any, attr: str) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        note(call_site())
        return original(*args, **kwargs)

    _patched.append((owner, attr, original))
    setattr(owner, attr, wrapper)


def track() -> None:
    """Remember the call site of every `torch.load` / `load_state_dict` (idempotent)."""
    if _patched:
        return
    _wrap(torch, "load")
    _wrap(torch.nn.Module, "load_state_dict")
    _wrap(torch.optim.Optimizer, "load_state_dict")


def untrack() -> None:
    """Undo `track()`."""
    global _last
    while _patched:
        owner, attr, original = _patched.pop()
        setattr(owner, attr, original)
    _last = None
