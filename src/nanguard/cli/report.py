"""`nanguard report RUN [RUN...]`: print the summary of a recorded run (`--json`: report.json;
`--html [FILE]`: a self-contained HTML report, by default RUN/report.html; several runs are
overlaid in one page and need FILE; `--schema`: the JSON Schema report.json follows)."""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.cli.main import add_command, add_json, wants_json
from nanguard.errors import UserError
from nanguard.record.report import OK_STATUSES, load_report, report_schema
from nanguard.record.store import DB_NAME, dec, open_run

if TYPE_CHECKING:  # rich is imported when the command prints, not by every command's parser
    from rich.console import Console


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "report", help="print the summary of a recorded run", description=__doc__,
        ok="every run is healthy, warned or recovered (or still running, nothing non-finite "
        "seen yet)",
        one="a run failed, crashed, was interrupted, died, stood down (degraded) or was "
        "never watched",
        two="bad arguments, or not a run folder")
    p.add_argument("run", nargs="*", help="a run folder (holds run.db and report.json); "
                   "several: each summary, or with --html one page overlaying them")
    add_json(p, "report.json (a list of them for several runs) instead of the summary")
    p.add_argument("--html", nargs="?", const="", default=None, metavar="FILE",
                   help="also write a self-contained HTML report (opens offline) to FILE; "
                   "default RUN/report.html (needs FILE for several runs)")
    p.add_argument("--full", action="store_true",
                   help="every cause with its evidence, the alarms and actions as tables and "
                   "the last steps as numbers (default: the summary that fits a screen)")
    p.add_argument("--schema", action="store_true",
                   help="print the JSON Schema of report.json (draft 2020-12) and exit")
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
    label = (first or {}).get("part") or next(iter(info.get("parts") or {}), None)
    return _part_folder(run, info, label) if label else None


def _part_folder(run: str, info: dict[str, Any], label: str) -> str | None:
    """The folder holding part `label`'s run.db: as report.json records it, else `run/label`."""
    folder = ((info.get("parts") or {}).get(label) or {}).get("folder")
    for where in (folder, str(Path(run) / label)):
        if where and (Path(where) / DB_NAME).is_file():
            return str(where)
    return None


def run(args: argparse.Namespace) -> int:
    if getattr(args, "schema", False):
        print(json.dumps(report_schema(), indent=2))
        return 0
    runs: list[str] = list(args.run) if isinstance(args.run, (list, tuple)) else [args.run]
    if not runs:
        raise UserError("give a run folder (or --schema for the schema of report.json)")
    html_out = getattr(args, "html", None)
    if html_out == "" and len(runs) > 1:
        raise ValueError("several runs: pass the page to write, --html FILE")
    reports = [load_report(r) for r in runs]
    if wants_json(args):
        dicts = [r.to_dict() for r in reports]
        print(json.dumps(dicts[0] if len(dicts) == 1 else dicts, indent=2))
    else:
        from rich.console import Console

        console = Console()
        for folder_arg, report in zip(runs, reports, strict=True):
            _print_one(console, folder_arg, report, full=bool(getattr(args, "full", False)))
    if html_out is not None:
        from nanguard.show.html import write_html

        path = write_html(runs, html_out or str(Path(runs[0]) / "report.html"))
        print(f"nanguard report: HTML report in {path}", file=sys.stderr)
    # A CI gate can trust it: only a run that was watched and ended healthy, warned or
    # recovered passes; failed, crashed, interrupted, died, degraded and unwatched do not.
    # A run still training passes while nothing non-finite has been seen in it.
    return 0 if all(r.status in OK_STATUSES or (r.status == "running"
                                                and r.first_nonfinite is None)
                    for r in reports) else 1


def _print_one(console: Console, folder_arg: str, report: Any, *, full: bool) -> None:
    """The terminal summary of one run, with its last steps (read from its run.db)."""
    from nanguard.show.summary import print_summary  # imports torch

    first = report.first_nonfinite
    until = first["step"] + 1 if first else None
    folder = _history_folder(folder_arg, report.run, first)
    rows = _last_steps(folder, until) if folder is not None else []
    print_summary(report, console=console, rows=rows, full=full,
                  parts_rows=_parts_steps(folder_arg, report.run, first))


def _parts_steps(run: str, info: dict[str, Any], first: dict[str, Any] | None
                 ) -> dict[str, list[dict[str, float | None]]]:
    """Each part's last steps for a merged run (several optimizers or ranks), the parts the
    closing summary shows (`show.summary.parts_shown`), the failing one's up to its first
    non-finite value. Empty for a run of one part."""
    from nanguard.show.summary import parts_shown

    parts = list(info.get("parts") or {})
    if len(parts) < 2 or (Path(run) / DB_NAME).is_file():
        return {}
    failing = (first or {}).get("part")
    out: dict[str, list[dict[str, float | None]]] = {}
    for label in parts_shown(info, parts, failing):
        folder = _part_folder(run, info, label)
        if folder is not None:
            until = first["step"] + 1 if first and label == failing else None
            out[label] = _last_steps(folder, until)
    return out
