"""Exceptions raised to the user."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanguard.record.report import Report


class NanguardError(RuntimeError):
    """Training stopped by the `raise` policy. `.report` holds the full report."""

    def __init__(self, message: str, report: Report) -> None:
        super().__init__(message)
        self.report = report


class UserError(ValueError):
    """A mistake in what the user asked for (a bad path, a file of the wrong kind, arguments
    that do not fit together). The CLI prints it as one line and exits with code 2.

    It subclasses ValueError, the project's exception for users' mistakes, so Python callers
    catching ValueError catch it too.
    """
