"""Live lines: the run's events on the terminal as they happen, through stdlib `logging`.

Everything goes to the logger `nanguard`, so the standard tools silence or redirect it
(`logging.getLogger("nanguard").setLevel(logging.ERROR)`, a handler of your own, `nanguard run
--quiet` / `--log-level`). When the program has configured no logging at all, a handler of
nanguard's own writes the lines to stderr: rich's on a terminal, plain `nanguard: ...` lines
otherwise. Once the program configures the root logger, that handler steps aside and the
records reach the program's handlers by the usual propagation (never twice).

What is shown: the alarm that opens an episode and each that makes it graver (WARNING; a
non-finite value or an overflow at ERROR), every action (skip, rollback at WARNING; raise and
give_up at ERROR; the GradScaler's routine skips at DEBUG), the finding (ERROR), the end of an
episode in which non-finite values persisted (with its count), nanguard standing down.

When a line leaves: on the CPU, and under every acting policy, inside the `optimizer.step()`
of the step that raised it (before the next step starts). Under `observe` on a GPU the step's
statistics are read one step late so that no step waits on the device: the line leaves during
the next `optimizer.step()`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from nanguard.record.events import Event

LOGGER = "nanguard"
log = logging.getLogger(LOGGER)


# What an alarm that opens or escalates an episode means for the person reading the line.
MEANING = {
    "spike": "a sudden jump: it heals in a step or two, or the optimizer feeds it back",
    # No "within a few steps": a cascade is a few steps of growth, which the next batches
    # may undo (pytorch/examples' regression: three 100x loss jumps, each gone in two
    # steps); how soon a value leaves its dtype is the forecast's to say.
    "cascade": "the optimizer is feeding the error back; if the growth goes on, values "
               "overflow unless the LR drops or the update is clipped",
    "forecast": "at this growth rate the value leaves the dtype's range",
    "divergence": "the loss is running away from where it was",
    "overflow": "a norm left float32's range: clipping by it would zero the update",
    "nonfinite": "NaN/Inf from here on unless something acts; the finding follows",
    "vanishing": "the model has stopped learning through these gradients",
    "amp_collapse": "fp16 overflows at any loss scale: the values themselves are too large",
    "saturation": "a probability a log reads is about to round to 0 or 1",
    "replica_divergence": "silent corruption: ranks that should hold the same weights do not",
    "checkpoint_mismatch": "silent corruption: the state trained from is not what was saved",
    "eval_nonfinite": "in evaluation, not training: loggers often drop NaN points silently",
    "buffer_nonfinite": "training does not read it, evaluation will: its outputs turn NaN",
    "rerun_mismatch": "silent corruption or a non-deterministic kernel: the same step computed "
                      "twice gave two results",
}


def format_event(event: Event) -> str:
    """The line for `event` (without the `nanguard:` prefix)."""
    if event.type == "alarm":
        meaning = MEANING.get(event.kind)
        if event.kind == "nonfinite" and event.signal == "activation" \
                and event.message == event.data.get("message"):
            # Its own text, not the step's summary of several non-finite signals
            # (`Events.alarms`): the loss, gradients and parameters are finite, so it has not
            # reached an update: no "from here on".
            meaning = ("seen in a forward of this step whose loss and gradients are finite: "
                       "no update used it; the finding follows")
        return (f"step {event.step} {event.kind}: {event.message}"
                + (f" -- {meaning}" if meaning else ""))
    if event.type == "action":
        return f"step {event.step} action {event.kind}: {event.message}"
    return event.message


def log_event(event: Event) -> None:
    """The listener the guard subscribes: one record on the `nanguard` logger per event
    worth a line (see the module docstring); alarms that add nothing to an open episode at
    DEBUG."""
    level = event.level if event.notable else logging.DEBUG
    if log.isEnabledFor(level):
        rank = _rank()
        where = ", ".join(w for w in (f"rank {rank}" if rank is not None else "", event.part or "")
                          if w)
        log.log(level, "%s%s", f"{where}: " if where else "",
                format_event(event), extra={"nanguard_event": event})


def _rank() -> int | None:
    """This process's rank under torch.distributed with several ranks (each rank says what it
    saw: a NaN on rank 3 is rank 3's line), else None. Looked up without importing torch."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized() \
                and dist.get_world_size() > 1:
            return int(dist.get_rank())
    except (RuntimeError, ValueError):
        pass
    return None


class _RootSilent(logging.Filter):
    """Passes records only while the root logger has no handlers: once the program has
    configured logging, its handlers show nanguard's records (by propagation), not ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not logging.getLogger().handlers


def _around_bars(emit: Any) -> Any:
    """`emit`, run with the program's tqdm progress bars lifted off the terminal and drawn
    again after the line (`tqdm.external_write_mode`): on a bar's line, a live line read
    `train:  47%|####5     | 56/120 [...]nanguard: step 65 ...`. Only when the program
    itself imported tqdm and a bar is open; nanguard never imports it."""

    def emit_around_bars(record: logging.LogRecord) -> None:
        tq = sys.modules.get("tqdm")
        bars = getattr(getattr(tq, "tqdm", None), "_instances", None)
        if bars:
            try:
                ctx = tq.tqdm.external_write_mode(file=sys.stderr)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - an older tqdm: the line as it is
                ctx = None
            if ctx is not None:
                with ctx:
                    emit(record)
                return
        emit(record)

    return emit_around_bars


class _Stderr(logging.StreamHandler):
    """Plain lines to whatever `sys.stderr` is at the time (pytest and `nanguard run`
    replace it), flushed at once."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("nanguard: %(message)s"))

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _terminal_handler() -> logging.Handler:
    """rich's handler on a terminal (time, level colour, wrapping), plain lines otherwise."""
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return _Stderr()
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(console=Console(stderr=True), show_time=False, show_path=False,
                          markup=False, rich_tracebacks=False)
    handler.setFormatter(logging.Formatter("nanguard: %(message)s"))
    return handler


def ensure_handler() -> None:
    """Give the `nanguard` logger its terminal handler, once per process, unless the program
    has already given it one of its own."""
    if any(getattr(h, "_nanguard_own", False) for h in log.handlers) or log.handlers:
        return
    handler = _terminal_handler()
    handler.emit = _around_bars(handler.emit)  # type: ignore[method-assign]
    handler._nanguard_own = True  # type: ignore[attr-defined]
    handler.addFilter(_RootSilent())
    log.addHandler(handler)


def set_level(level: str | int | None = None, *, quiet: bool = False) -> None:
    """`nanguard run --log-level LEVEL` / `--quiet`: what the live log shows (quiet: only
    nanguard's own internal errors)."""
    if quiet:
        log.setLevel(logging.CRITICAL)
    elif level is not None:
        name = level.upper() if isinstance(level, str) else level
        if isinstance(name, str) and name not in ("DEBUG", "INFO", "WARNING", "ERROR",
                                                  "CRITICAL"):
            raise ValueError(f"unknown log level {level!r}; use DEBUG, INFO, WARNING, ERROR "
                             "or CRITICAL")
        log.setLevel(name)


@contextmanager
def muted() -> Iterator[None]:
    """No live lines inside the block (the demo trains many guards and prints its own table);
    the level is restored after."""
    old = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(old)
