"""Entry point of the `nanguard` command.

Each subcommand lives in its own module of this package and exposes two functions:
`register(subparsers)` adds its parser, and the parser's `func` default is called with
the parsed namespace and returns the exit code. Exit codes: 0 healthy, 1 training failed
(or an alarm under the `raise` policy), 2 user error with a one-line message.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Module names (within nanguard.cli) that provide subcommands, in help order.
COMMANDS: tuple[str, ...] = ("run", "demo", "report", "dashboard", "replay", "audit", "scan",
                             "lint", "export")


class UserError(Exception):
    """A mistake by the user (bad path, bad file): printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nanguard",
        description="Keep PyTorch training numerically healthy: watch, warn, pinpoint, recover.",
    )
    from nanguard import __version__

    parser.add_argument("--version", action="version", version=f"nanguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"nanguard.cli.{name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except (UserError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError) as exc:
        print(f"nanguard {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("nanguard: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
