"""`nanguard lint PATH...`: static checks of training code for numerical mistakes.

Output is one line per finding, ``path:line:col: CODE message (fix: ...)``. Exit codes like
other linters: 0 clean, 1 findings, 2 bad path or unparsable file. ``# noqa`` or
``# noqa: NG003`` on the line silences a finding.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from nanguard.cli.main import add_command, add_json, wants_json


def _codes(text: str | None) -> set[str] | None:
    from nanguard.audit.lint import RULES

    if text is None:
        return None
    codes = {c.strip().upper() for c in text.split(",") if c.strip()}
    unknown = sorted(codes - set(RULES))
    if unknown:
        raise ValueError(f"unknown rule code {unknown[0]} (known: {', '.join(RULES)})")
    return codes


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "lint",
        ok="no findings",
        one="findings (one line each)",
        two="a bad path, an unparsable file or an unknown rule code",
        help="check training code statically for numerical mistakes (NG001..)",
        description="Static analysis of training code: sigmoid then BCE, softmax then log, "
        "log / sqrt / division without eps, norm layers and Adam with eps too small, "
        "register_backward_hook, torch.load without weights_only.",
    )
    p.add_argument("paths", nargs="*", metavar="PATH", help="files or directories (recursive)")
    p.add_argument("--select", metavar="CODES", help="only these codes, e.g. NG001,NG003")
    p.add_argument("--ignore", metavar="CODES", help="skip these codes")
    add_json(p, "the findings", legacy_format="text")
    p.add_argument("--list-rules", action="store_true", help="print the rules and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanguard.audit.lint import RULES, lint_paths

    if args.list_rules:
        for code, text in RULES.items():
            print(f"{code}  {text}")
        return 0
    if not args.paths:
        raise ValueError("no PATH given (a .py file or a directory)")
    findings = lint_paths(args.paths, select=_codes(args.select), ignore=_codes(args.ignore))
    if wants_json(args):
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    else:
        for f in findings:
            print(f.format())
        print(f"Found {len(findings)} problem(s)." if findings else "All checks passed.")
    return 1 if findings else 0
