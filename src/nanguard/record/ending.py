"""How a run ended: normally, by an error of the training itself, or by a signal.

A Guard closed by `with`, by `close()` or at interpreter exit must say in report.json how the
run ended, so that a crashed or killed run is never reported `healthy`. Two process-wide
hooks, installed while at least one Guard is open and removed with the last one:

* `sys.excepthook` is chained: an uncaught exception (the training crashed) is noted before
  Python prints it; `atexit` — where a forgotten Guard is closed — runs after it.
* SIGTERM (a cluster scheduler's time limit, `timeout`), when its handler is still the
  default, raises `SystemExit(143)` in the main thread like SIGINT raises KeyboardInterrupt:
  `finally` blocks, `with` exits and `atexit` run, so report.json is written. A handler the
  program installed itself is left alone.
"""

from __future__ import annotations

import atexit
import signal
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

ENDINGS = ("ok", "error", "interrupted", "stopped")
"""`ok`: the training returned normally; `error`: it raised (or exited non-zero);
`interrupted`: SIGINT or SIGTERM stopped it; `stopped`: nanguard's `raise` policy stopped it.
(A report rebuilt from run.db of a process that never closed its guard says `died`.)"""

_users = 0
_saw: tuple[str, str | None] | None = None
_previous_hook: Any = None
_previous_term: Any = None


def _excepthook(tp: type[BaseException], value: BaseException,
                tb: types.TracebackType | None) -> None:
    global _saw
    _saw = classify(value)
    (_previous_hook or sys.__excepthook__)(tp, value, tb)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _saw
    _saw = ("interrupted", "SIGTERM")
    raise SystemExit(128 + signal.SIGTERM)


def classify(exc: BaseException | None) -> tuple[str, str | None]:
    """(ending, message) for an exception that ended the training (None: it returned)."""
    if exc is None:
        return "ok", None
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", "KeyboardInterrupt"
    if isinstance(exc, SystemExit):
        if _saw is not None and _saw[0] == "interrupted":
            return _saw
        code = exc.code
        if code is None or code == 0:
            return "ok", None
        return "error", f"SystemExit({code!r})"
    return "error", f"{type(exc).__name__}: {exc}"


def seen() -> tuple[str, str | None]:
    """How the process is ending, as far as the hooks saw (`ok` when they saw nothing)."""
    return _saw or ("ok", None)


def settle(ended: str | None, error: str | None) -> tuple[str, str | None]:
    """How a closing run ended: `ended` and `error` as given to `Guard.close`, or when `ended`
    is None, as far as the hooks saw. Raises ValueError on an ending not in `ENDINGS`."""
    if ended is None:
        ended, error = seen()
    if ended not in ENDINGS:
        raise ValueError(f"unknown ending {ended!r}; use one of: {', '.join(ENDINGS)}")
    return ended, error


def acquire() -> None:
    """A Guard opened: make sure the hooks are installed."""
    global _users, _previous_hook, _previous_term
    _users += 1
    if _users > 1:
        return
    _previous_hook = sys.excepthook
    sys.excepthook = _excepthook
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                _previous_term = signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not settable here (embedded interpreters)
            _previous_term = None


def release() -> None:
    """A Guard closed: remove the hooks with the last one (only if still ours)."""
    global _users, _previous_hook, _previous_term
    _users = max(0, _users - 1)
    if _users:
        return
    if sys.excepthook is _excepthook:
        sys.excepthook = _previous_hook or sys.__excepthook__
    _previous_hook = None
    if _previous_term is not None and threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is _on_sigterm:
                signal.signal(signal.SIGTERM, _previous_term)
        except (ValueError, OSError):
            pass
    _previous_term = None


def close_at_exit(closeable: Any) -> Callable[[], None]:
    """Call `closeable.close()` at interpreter exit if the program never did; returns the
    registered function (for `atexit.unregister` at close). Holds it weakly: a dropped guard
    is not kept alive."""
    ref = weakref.ref(closeable)

    def closer() -> None:
        if (obj := ref()) is not None:
            obj.close()

    atexit.register(closer)
    return closer
