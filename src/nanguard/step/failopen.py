"""Fail open: the one wrapper around every entry point of nanguard's own code into a training
loop (the Guard's hooks and calls, the zero-code runner's patches).

A monitor never breaks training. A method wrapped with `fail_open(where)` runs unless its owner
has already stood down (then it does nothing and returns None); an unexpected error inside it
is handed to the owner's `stand_down(exc, where)` (which records it with
`record.standdown.note_internal_error`, removes the hooks and leaves training as it would run
without nanguard) and the call returns None. Two things pass through: the `raise` policy's
`NanguardError` (stopping training is that policy's job) and a `BaseException` that is not an
`Exception` (KeyboardInterrupt, SystemExit, the preflight's stop).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from nanguard.errors import NanguardError

__all__ = ["StandsDown", "fail_open"]


class StandsDown(Protocol):
    """What a wrapped method's owner provides."""

    error: dict[str, Any] | None
    """Set once it stood down; the wrapped methods do nothing since."""

    def stand_down(self, exc: BaseException, where: str) -> None: ...


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def fail_open(where: str) -> Callable[[_Fn], _Fn]:
    """Wrap a method of a `StandsDown` owner (see the module docstring); `where` names the
    entry point in the record (`optimizer step pre-hook`, `watch`, ...)."""

    def wrap(fn: _Fn) -> _Fn:
        @functools.wraps(fn)
        def contained(self: StandsDown, *args: Any, **kwargs: Any) -> Any:
            if self.error is not None:
                return None
            try:
                return fn(self, *args, **kwargs)
            except NanguardError:
                raise
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                self.stand_down(exc, where)
                return None

        return cast(_Fn, contained)

    return wrap
