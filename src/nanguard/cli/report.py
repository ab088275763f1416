"""`nanguard report RUN`: print the summary of a recorded run (`--json`: report.json)."""

from __future__ import annotations

import argparse
import json
import sqlite3

from rich.console import Console

from nanguard.record.report import load_report
from nanguard.record.store import dec, open_run
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


def run(args: argparse.Namespace) -> int:
    report = load_report(args.run)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        first = report.first_nonfinite
        until = first["step"] + 1 if first else None
        console = Console()
        print_summary(report, console=console)
        print_last_steps(console, _last_steps(args.run, until))
    return 1 if report.status == "failed" else 0
