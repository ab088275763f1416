"""`nanguard report RUN`: print the summary of a recorded run (`--json`: report.json)."""

from __future__ import annotations

import argparse
import json
import sqlite3
from pathlib import Path
from typing import Any

from rich.console import Console

from nanguard.record.report import OK_STATUSES, load_report
from nanguard.record.store import DB_NAME, dec, open_run
from nanguard.show.summary import print_last_steps, print_summary


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report", help="print the summary of a recorded run", description=__doc__
    )
    p.add_argument("run", help="a run folder (holds run.db and report.json)")
    p.add_argument("--json", action="store_true", help="print report.json instead")
    p.set_defaults(func=run)


def _last_steps(folder: str, until: int | None, n: int = 24) -> list[dict[str, float | None]]:
    """The `n` steps up to `until` (the first non-finite step + 1) or the end of the run."""
    db = open_run(folder)
    try:
        rows = db.execute(
            "SELECT step, loss, grad_norm, act_max, momentum_norm FROM steps WHERE step <= ? "
            "ORDER BY step DESC LIMIT ?",
            (until if until is not None else 2**62, n),
        ).fetchall()
    except sqlite3.DatabaseError:
        return []
    finally:
        db.close()
    keys = ("loss", "grad_norm", "act_max", "momentum_norm")
    return [
        {"step": r[0], **{k: dec(v) for k, v in zip(keys, r[1:], strict=True)}}
        for r in reversed(rows)
    ]


def _history_folder(run: str, info: dict[str, Any], first: dict[str, Any] | None) -> str | None:
    """Where the step history lives: the run folder, or for a merged run (several optimizers
    or ranks) the part where the first non-finite value showed, else the first part."""
    if (Path(run) / DB_NAME).is_file():
        return run
    parts = info.get("parts") or {}
    label = (first or {}).get("part") or next(iter(parts), None)
    folder = (parts.get(label) or {}).get("folder") if label else None
    if folder and (Path(folder) / DB_NAME).is_file():
        return str(folder)
    if label and (Path(run) / label / DB_NAME).is_file():
        return str(Path(run) / label)
    return None


def run(args: argparse.Namespace) -> int:
    report = load_report(args.run)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        first = report.first_nonfinite
        until = first["step"] + 1 if first else None
        folder = _history_folder(args.run, report.run, first)
        console = Console()
        print_summary(report, console=console)
        if folder is not None:
            print_last_steps(console, _last_steps(folder, until))
    # A CI gate can trust it: only a run that was watched and ended healthy, warned or
    # recovered passes; failed, crashed, interrupted, died, degraded and unwatched do not.
    return 0 if report.status in OK_STATUSES else 1
