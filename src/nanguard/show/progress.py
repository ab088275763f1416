"""Progress on the long quiet waits: the demo's seeds, the re-run that pinpoints a step, `replay`.

A rich progress bar (or a spinner when the total is unknown) on stderr, shown only on a
terminal and cleared when the wait ends; off the terminal (a log file, CI) one plain line says
what is being waited for, so a long silence is never a mystery. The output of the command
itself (stdout) is untouched.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Tick(Protocol):
    def __call__(self, completed: float | None = None, *, note: str | None = None) -> None: ...


def _tty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@contextmanager
def waiting(what: str, total: float | None = None, *, unit: str = "") -> Iterator[Tick]:
    """Show progress while the block runs; yields `tick(completed=None, note=None)`: with
    `completed`, the bar moves to it (else it advances by one); `note` replaces the text.

    Args:
        what: what is being waited for, e.g. "re-running step 412 to pinpoint it".
        total: the bar's end (seeds, seconds of a budget); None: a spinner.
        unit: shown after the count (`s`, `seeds`).
    """
    if not _tty():
        print(f"nanguard: {what}" + (f" ({total:g} {unit})".replace("  ", " ") if total
                                       else "") + " ...",
              file=sys.stderr, flush=True)
        yield lambda completed=None, *, note=None: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns: list[Any] = [SpinnerColumn(), TextColumn("nanguard: {task.description}")]
    if total is not None:
        columns += [BarColumn(), MofNCompleteColumn() if not unit else
                    TextColumn(f"{{task.completed:.0f}}/{{task.total:.0f}} {unit}")]
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)

        def tick(completed: float | None = None, *, note: str | None = None) -> None:
            if completed is None:
                bar.advance(task)
            else:
                bar.update(task, completed=completed)
            if note is not None:
                bar.update(task, description=note)

        yield tick
