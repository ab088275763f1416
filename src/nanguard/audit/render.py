"""Terminal rendering shared by the offline auditors' CLI commands (rich, to stdout)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from nanguard.audit.common import AuditFinding

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


def print_findings(con: Any, findings: Sequence[AuditFinding]) -> None:
    from rich.markup import escape

    for f in findings:
        style = _STYLE.get(f.severity, "")
        fix = f"  [dim](fix: {escape(f.fix)})[/dim]" if f.fix else ""
        con.print(f"[{style}]{f.severity}[/{style}] {f.code}: {escape(f.message)}{fix}")


def print_folder(con: Any, report: Any, print_file: Any, *, show_all: bool) -> None:
    """A folder's report (`nanguard.audit.folder.FolderReport`): one row per file (and per
    file left out), with `show_all` each file as the single-file command shows it
    (`print_file(con, file_report, None)`), the findings under the file they are about, and
    a last line with the totals."""
    import os

    from rich.markup import escape

    rows = []
    for name, r in report.files:
        bad = [f for f in r.findings if f.severity != "info"]
        size = (f"{len(r.tensors)} tensors" if hasattr(r, "tensors")
                else f"{sum(t.rows for t in r.tables)} rows")
        rows.append([name, getattr(r, "format", "") or os.path.splitext(name)[1][1:], size,
                     len(bad) or ""])
    for s in report.skipped:
        rows.append([s["file"], "skipped", s["reason"], ""])
    con.print(table(f"{report.path}: {len(report.files)} files",
                    ("file", "format", "size", "problems"), rows))
    if show_all:
        for _, r in report.files:
            print_file(con, r, None)
    for name, r in report.files:  # each file's findings under its name
        if r.findings:
            con.print(f"[bold]{escape(name)}[/]")
            print_findings(con, r.findings)
    if report.findings:
        con.print(f"[bold]{escape(report.path)}[/] (the folder)")
        print_findings(con, report.findings)
    total = report.total()
    n = total["errors"] + total["warnings"]
    counts = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in total.items()
                       if k not in ("errors", "warnings"))
    con.print(f"total: {counts}; " + ("no problems found" if not n else f"{n} problem(s) found"),
              markup=False)
