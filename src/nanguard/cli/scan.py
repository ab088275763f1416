"""`nanguard scan DATA`: check a data file for values that break training.

DATA may be a folder (a data set in shards): every data file under it is scanned (row numbers
are per file) and the result given per file and in total.

Exit codes: 0 clean, 1 problems found, 2 unreadable file or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from nanguard.cli.main import add_command, add_json, wants_json
from nanguard.errors import UserError


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "scan",
        ok="clean: no problem found",
        one="problems found (errors or warnings)",
        two="bad arguments or a file that cannot be read",
        help="scan a data file (CSV, Parquet, .npy/.npz, torch tensors) for NaN/Inf and more",
        description="Scan a data set in one streaming pass: NaN/Inf/missing cells by row and "
        "column (0-based; the CSV header is not a row), extreme magnitudes, constant columns, "
        "broken one-hot groups, labels out of range, and per-column mean and std.",
    )
    p.add_argument("data", help="a .csv, .tsv, .parquet, .npy, .npz or .pt file, or a folder "
                   "of them (a data set in shards: per file and in total)")
    p.add_argument("--label", metavar="COL", help="integer class-label column to check")
    p.add_argument("--num-classes", type=int, metavar="K", help="labels must lie in [0, K)")
    p.add_argument(
        "--onehot",
        action="append",
        default=[],
        metavar="PREFIX",
        help="columns starting with PREFIX must be one-hot (repeatable)",
    )
    p.add_argument(
        "--no-auto-onehot",
        action="store_true",
        help="do not look for one-hot groups by column-name prefix",
    )
    p.add_argument(
        "--max-abs",
        type=float,
        default=1e6,
        metavar="X",
        help="report values with |x| > X (default 1e6)",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="COL",
        help="leave COL out of the extreme / constant / one-hot checks (repeatable)",
    )
    p.add_argument(
        "--trust",
        action="store_true",
        help="a .pt/.pth file you trust (you made it): load it with weights_only=False so "
        "numpy arrays and other objects inside it can be read; this runs code stored in the "
        "file, so never use it for a file from elsewhere",
    )
    add_json(p, "the scan", legacy_format="table")
    p.add_argument("--all", action="store_true", help="list every column, not only the first 30")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanguard.audit.render import console, print_findings
    from nanguard.audit.scan import ScanConfig, scan_file

    if args.num_classes is not None and args.label is None:
        raise ValueError("--num-classes needs --label COL")
    config = ScanConfig(
        max_abs=args.max_abs,
        label=args.label,
        num_classes=args.num_classes,
        onehot=args.onehot,
        auto_onehot=not args.no_auto_onehot,
        ignore=args.ignore,
    )
    import contextlib

    from nanguard.audit.scan_readers import trusting

    if os.path.isdir(args.data):
        from nanguard.audit.folder import scan_folder
        from nanguard.cli.audit import print_folder

        if args.trust:
            raise UserError("--trust takes one .pt file you made, not a folder")
        return print_folder(args, scan_folder(args.data, config),
                            lambda con, r, _: _print_tables(con, r, True))
    with trusting(args.data) if args.trust else contextlib.nullcontext():
        report = scan_file(args.data, config)
    if wants_json(args):
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.ok else 1
    con = console()
    _print_tables(con, report, args.all)
    print_findings(con, report.findings)
    n = sum(f.severity != "info" for f in report.findings)
    con.print("no problems found" if not n else f"{n} problem(s) found")
    return 0 if report.ok else 1


def _print_tables(con: Any, report: Any, show_all: bool) -> None:
    """Per table of a scanned file, its columns' statistics (flagged columns first)."""
    from nanguard.audit.common import fmt_num
    from nanguard.audit.render import table

    flagged = {f.details.get("column_name") for f in report.findings}
    for tab in report.tables:
        cols = sorted(tab.columns, key=lambda c: c.name not in flagged)
        shown = cols if show_all else cols[:30]
        rows = [
            [
                c.name,
                c.count,
                fmt_num(c.mean),
                fmt_num(c.std),
                fmt_num(c.min),
                fmt_num(c.max),
                c.nan or "",
                (c.posinf + c.neginf) or "",
                c.missing or "",
            ]
            for c in shown
        ]
        title = f"{tab.name}: {tab.rows} rows x {len(tab.columns)} numeric columns"
        con.print(
            table(
                title,
                ("column", "count", "mean", "std", "min", "max", "nan", "inf", "missing"),
                rows,
            )
        )
        if len(cols) > len(shown):
            con.print(f"... {len(cols) - len(shown)} more columns (--all to list them)")
