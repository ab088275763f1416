"""Entry point of the `nanguard` command.

Each subcommand lives in its own module of this package and exposes `register(subparsers)`,
which adds its parser (built with `add_command`, so every `--help` ends with the command's
exit codes); the parser's `func` default is called with the parsed namespace and returns the
exit code.

Conventions every subcommand keeps:

- `--json` prints the result as JSON on stdout (where a command prints a result).
- Exit codes: 0 healthy / clean, 1 training failed or problems found, 2 a mistake in the
  command line or its input (one line on stderr, no traceback), 3 an error of nanguard's own
  (a bug: one line saying so, and the file the traceback was written to).
- Nothing here imports torch: `nanguard --help`, `--version` and `lint` answer without it; a
  subcommand imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from nanguard.errors import UserError

# Module names (within nanguard.cli) that provide subcommands, in help order.
COMMANDS: tuple[str, ...] = ("run", "demo", "report", "dashboard", "replay", "audit", "scan",
                             "lint", "export")

EXIT_INTERNAL = 3

__all__ = ["COMMANDS", "EXIT_INTERNAL", "UserError", "add_command", "build_parser", "main"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a text already laid out in lines (a module docstring,
    the exit-code epilog) keeps its lines; a one-line text is wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text.strip():
            return super()._fill_text(text, width, indent)
        return "".join(indent + line for line in text.splitlines(keepends=True))


class Parser(argparse.ArgumentParser):
    """argparse's parser, except that a mistake on the command line is one line on stderr in
    the wording every error of the CLI uses (`nanguard run: error: ... (see nanguard run
    --help)`), exit 2, instead of the usage block and then the error. Subcommand parsers are
    of this class too (`add_subparsers` makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())  # argparse's messages may hold line breaks
        self.exit(2, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def exit_codes(ok: str, one: str, two: str = "a mistake in the command line or its input "
               "(one line on stderr)") -> str:
    """The epilog every subcommand's --help ends with, laid out in lines of at most 79."""
    codes = ((0, ok), (1, one), (2, two),
             (EXIT_INTERNAL, "an error of nanguard's own (a bug): one line on stderr names "
              "the file the traceback was written to"))
    lines = ["exit codes:"]
    for code, meaning in codes:
        lines += textwrap.wrap(meaning, 79, initial_indent=f"  {code}  ",
                               subsequent_indent=" " * 5)
    return "\n".join(lines) + "\n"


def add_command(subparsers: Any, name: str, *, ok: str, one: str, two: str | None = None,
                **kwargs: Any) -> argparse.ArgumentParser:
    """Add a subcommand whose --help ends with its exit codes (`ok`: what 0 means, `one`:
    what 1 means, `two`: what 2 means when it is more than a bad argument or path)."""
    epilog = exit_codes(ok, one) if two is None else exit_codes(ok, one, two)
    return subparsers.add_parser(name, epilog=epilog, formatter_class=HelpFormatter, **kwargs)


def add_json(parser: argparse.ArgumentParser, what: str, *, legacy_format: str | None = None
             ) -> None:
    """The one JSON flag, `--json`. `legacy_format` (the human format's name, e.g. "table")
    keeps the older `--format {legacy,json}` working, hidden from --help and deprecated."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")
    if legacy_format is not None:
        parser.add_argument("--format", choices=(legacy_format, "json"), default=None,
                            help=argparse.SUPPRESS)


def wants_json(args: argparse.Namespace) -> bool:
    """Whether --json (or the deprecated --format json) was given."""
    if getattr(args, "format", None) == "json":
        print(f"nanguard {args.command}: --format json is deprecated; use --json",
              file=sys.stderr)
        return True
    return bool(getattr(args, "json", False))


def build_parser() -> argparse.ArgumentParser:
    from nanguard import __version__

    parser = Parser(
        prog="nanguard",
        description="Keep PyTorch training numerically healthy: watch, warn, pinpoint, recover.",
        epilog=exit_codes("healthy run / nothing found",
                          "training failed, or problems found") +
        "\n`nanguard COMMAND --help` says what each command does and what its codes mean.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"nanguard {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"nanguard.cli.{name}")
        module.register(subparsers)
    return parser


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' parsers by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _is_user_error(exc: BaseException) -> bool:
    """A mistake in the command line or its input, not a bug of nanguard's.

    `UserError` (and the auditors' `AuditInputError`) are raised deliberately at input checks.
    A plain `ValueError` is one of ours when a `raise` statement of nanguard's raised it (the
    project's rule: `ValueError` for users' mistakes); raised inside numpy, torch or a builtin
    (`int("x")` in nanguard's code) it is a call nanguard got wrong, so a bug. A missing or
    unreadable path is the user's.
    """
    if isinstance(exc, (UserError, FileNotFoundError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return True
    if not isinstance(exc, ValueError):
        return False
    from nanguard.audit.common import AuditInputError

    if isinstance(exc, AuditInputError):
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    package = str(Path(__file__).resolve().parents[1])
    if not frames:
        return False
    last = frames[-1]
    return (str(Path(last.filename).resolve()).startswith(package)
            and (last.line or "").lstrip().startswith("raise"))


def _write_traceback(argv: Sequence[str], command: str, exc: BaseException) -> str:
    """Write the traceback of an internal error where a user can attach it to a bug report."""
    from nanguard import __version__

    name = f"nanguard-error-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path = Path(tempfile.gettempdir()) / name
    text = (f"nanguard {__version__}, python {sys.version.split()[0]}\n"
            f"command: nanguard {' '.join(argv)}\n\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    path.write_text(text)
    return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the subcommand's parser, so the line names the command
        _subparsers(parser).get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("nanguard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `nanguard audit ... | head`: the reader left, nothing is wrong
        # What is still buffered goes nowhere, so the interpreter's final flush cannot fail
        # too (the recipe of Python's signal docs); 141 is what a shell reports for SIGPIPE.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, AttributeError, ValueError):  # a stdout with no file behind it
            pass
        return 141
    except Exception as exc:  # noqa: BLE001 - every error ends as one line, never a traceback
        if _is_user_error(exc):
            print(f"nanguard {args.command}: error: {exc}", file=sys.stderr)
            return 2
        try:
            where = f"the traceback is in {_write_traceback(argv, args.command, exc)}"
        except OSError:
            where = "the traceback could not be written to a file:\n" + traceback.format_exc()
        what = " ".join(str(exc).split())[:300]  # one line, however the message was laid out
        print(f"nanguard {args.command}: internal error (a bug in nanguard, not a mistake in "
              f"your input): {type(exc).__name__}: {what}; {where}; please report it",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    raise SystemExit(main())
