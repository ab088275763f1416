"""`nanguard audit CKPT [CKPT2]`: check a checkpoint offline, or diff two.

CKPT may be a folder (a sharded checkpoint such as a Hugging Face `checkpoint-N/`): every
checkpoint file under it is audited, the shard index checked against the shards, and the
result given per file and in total.

Exit codes: 0 no problem found, 1 problems found, 2 unreadable or unsafe file.
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
        "audit",
        ok="no problem found",
        one="problems found (errors or warnings)",
        two="bad arguments, a file that cannot be read, or an unsafe checkpoint (one that "
        "only loads by running pickled code: it is never loaded)",
        help="check a checkpoint (safetensors or torch) offline; diff two checkpoints",
        description="Audit a checkpoint without executing pickled code: non-finite values, "
        "magnitude outliers among peer tensors, optimizer-state sanity, content hashes. "
        "With two files, also say which tensors changed between them.",
    )
    p.add_argument("checkpoint", help="a .safetensors file, a file written by torch.save, or "
                   "a folder of them (a sharded checkpoint: per file and in total)")
    p.add_argument("other", nargs="?", help="a second checkpoint: diff CHECKPOINT -> OTHER")
    add_json(p, "the audit", legacy_format="table")
    p.add_argument("--all", action="store_true", help="list every tensor, not only the first 30")
    p.add_argument(
        "--manifest",
        metavar="PATH",
        help="verify against this manifest (default: CHECKPOINT.nanguard-manifest.json or "
        "nanguard-manifest.json beside it, when there is one)",
    )
    p.set_defaults(func=run)


def _tensor_rows(report: Any, limit: int | None) -> tuple[list[list[Any]], int]:
    from nanguard.audit.common import fmt_num

    flagged = {f.location for f in report.findings}
    ordered = sorted(report.tensors, key=lambda t: t.name not in flagged)
    shown = ordered if limit is None else ordered[:limit]
    rows = [
        [
            t.name,
            t.dtype,
            "x".join(map(str, t.shape)) or "scalar",
            t.nonfinite or "",
            fmt_num(t.absmax),
            fmt_num(t.rms),
            t.sha256[:12],
        ]
        for t in shown
    ]
    return rows, len(ordered) - len(shown)


def _print_report(con: Any, report: Any, limit: int | None) -> None:
    from nanguard.audit.render import print_findings, table

    rows, hidden = _tensor_rows(report, limit)
    cols = ("tensor", "dtype", "shape", "non-finite", "abs max", "rms", "sha256")
    con.print(table(f"{report.path} ({report.format}, {len(report.tensors)} tensors)", cols, rows))
    if hidden:
        con.print(f"... {hidden} more tensors (--all to list them)")
    if report.manifest is not None:
        m = report.manifest
        verdict = f"{len(m.mismatches)} mismatch(es)" if m.mismatches else "all match"
        # soft_wrap: one line whatever the path's length, so it can be grepped.
        con.print(f"manifest {m.manifest}: {m.checked} tensors verified, {verdict}", soft_wrap=True)
    print_findings(con, report.findings)


def run(args: argparse.Namespace) -> int:
    from nanguard.audit.checkpoint import audit_checkpoint, diff_checkpoints
    from nanguard.audit.common import fmt_num
    from nanguard.audit.folder import audit_folder
    from nanguard.audit.render import console, print_findings, table

    limit = None if args.all else 30
    if args.manifest and args.other is not None:
        raise UserError("--manifest verifies one checkpoint; audit OTHER on its own")
    if os.path.isdir(args.checkpoint) or (args.other and os.path.isdir(args.other)):
        if args.other is not None:
            raise UserError("a diff takes two checkpoint files, not folders")
        return print_folder(args, audit_folder(args.checkpoint), _print_report)
    if args.other is None:
        report: Any = audit_checkpoint(args.checkpoint, manifest=args.manifest)
    else:
        report = diff_checkpoints(args.checkpoint, args.other)
    if wants_json(args):
        print(json.dumps(report.to_dict(), indent=2))
        return 0 if report.ok else 1
    con = console()
    if args.other is None:
        _print_report(con, report, limit)
    else:
        for side in (report.a, report.b):
            con.print(f"{side.path} ({side.format}, {len(side.tensors)} tensors)")
            print_findings(con, side.findings)
        changes = sorted(report.changes, key=lambda c: -(c.rel_change or 0))
        rows = [
            [
                c.name,
                c.status,
                fmt_num(c.max_abs_diff),
                fmt_num(c.rel_change),
                "yes" if c.became_nonfinite else "",
            ]
            for c in (changes if limit is None else changes[:limit])
        ]
        con.print(
            table(
                f"diff: {len(report.changes)} tensors differ, {report.unchanged} identical",
                ("tensor", "status", "max |b-a|", "|b-a|/|a|", "became non-finite"),
                rows,
            )
        )
        print_findings(con, report.findings)
    n = sum(f.severity != "info" for f in _all_findings(report))
    con.print("no problems found" if not n else f"{n} problem(s) found")
    return 0 if report.ok else 1


def _all_findings(report: Any) -> list[Any]:
    if hasattr(report, "a"):
        return [*report.a.findings, *report.b.findings, *report.findings]
    return list(report.findings)


def print_folder(args: argparse.Namespace, report: Any, print_file: Any) -> int:
    """Show a folder's report (audit or scan): JSON with --json, else the tables of
    `nanguard.audit.render.print_folder`. Returns the exit code."""
    from nanguard.audit.render import console
    from nanguard.audit.render import print_folder as show

    if wants_json(args):
        print(json.dumps(report.to_dict(), indent=2))
    else:
        show(console(), report, print_file, show_all=args.all)
    return 0 if report.ok else 1
