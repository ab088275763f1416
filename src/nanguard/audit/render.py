"""Terminal rendering shared by the offline auditors' CLI commands (rich, to stdout)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from nanguard.audit._common import Finding

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def console() -> Any:
    """A rich Console on the current sys.stdout (so pytest's capsys sees it); wide enough
    that tensor and column names are not cut when the output is piped."""
    from rich.console import Console

    out = sys.stdout
    return Console(file=out, width=None if out.isatty() else 140, highlight=False)


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Any:
    from rich.table import Table

    tab = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for i, col in enumerate(columns):
        tab.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for row in rows:
        tab.add_row(*[str(v) for v in row])
    return tab


def print_findings(con: Any, findings: Sequence[Finding]) -> None:
    from rich.markup import escape

    for f in findings:
        style = _STYLE.get(f.severity, "")
        fix = f"  [dim](fix: {escape(f.fix)})[/dim]" if f.fix else ""
        con.print(f"[{style}]{f.severity}[/{style}] {f.code}: {escape(f.message)}{fix}")
