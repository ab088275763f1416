"""Fail open: the one wrapper around every entry point of nanguard's own code into a training
loop (the Guard's hooks and calls, the zero-code runner's patches).

A monitor never breaks training. A method wrapped with `fail_open(where)` runs unless its owner
has already stood down (then it does nothing and returns None); an unexpected error inside it
is handed to the owner's `stand_down(exc, where)` (which records it with
`record.standdown.note_internal_error`, removes the hooks and leaves training as it would run
without nanguard) and the call returns None. Two things pass through: the `raise` policy's
`NanguardError` (stopping training is that policy's job) and a `BaseException` that is not an
`Exception` (KeyboardInterrupt, SystemExit, the preflight's stop).

`contain(owner, exc, where)` is that handling on its own. The three entry points that run every
step (`StepPipeline.watch`, `pre_hook`, `post_hook`) call it from a `try` of their own
instead of wearing the decorator: a wrapper is one more Python frame per hook on every step,
and those three are the per-step cost of the whole guard. The rule is the same either way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from nanguard.errors import NanguardError

__all__ = ["StandsDown", "contain", "fail_open"]


class StandsDown(Protocol):
    """What a wrapped method's owner provides."""

    error: dict[str, Any] | None
    """Set once it stood down; the wrapped methods do nothing since."""

    def stand_down(self, exc: BaseException, where: str) -> None: ...


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def contain(owner: StandsDown, exc: Exception, where: str) -> None:
    """An error caught at the entry point `where` of `owner`: the `raise` policy's
    `NanguardError` goes on up; anything else stands `owner` down (module docstring). Called
    from an `except Exception` clause; returns normally when the error was contained."""
    if isinstance(exc, NanguardError):
        raise exc
    owner.stand_down(exc, where)


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
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                contain(self, exc, where)
                return None

        return cast(_Fn, contained)

    return wrap
