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
