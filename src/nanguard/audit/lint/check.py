"""Lint sources and paths: parse (engine), run every rule (rules), honour ``# noqa``."""

from __future__ import annotations

import ast

from nanguard.audit.common import AuditInputError
from nanguard.audit.lint.engine import (
    Context,
    LintFinding,
    iter_python_files,
    noqa_lines,
    read_python,
)
from nanguard.audit.lint.rules import run_rules

__all__ = ["lint_paths", "lint_source"]


def lint_source(source: str, path: str = "<string>") -> list[LintFinding]:
    """Lint Python source text.

    Raises:
        AuditInputError: the source does not parse.
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        raise AuditInputError(
            f"{path}:{exc.lineno or 0}:{exc.offset or 0}: syntax error: {exc.msg}"
        ) from None
    except ValueError as exc:  # null bytes
        raise AuditInputError(f"{path}: cannot parse ({exc})") from None
    ctx = Context(tree, path)
    run_rules(ctx)
    noqa = noqa_lines(source)
    seen, out = set(), []
    for f in sorted(ctx.findings, key=lambda f: (f.line, f.col, f.code)):
        codes = noqa.get(f.line, set())
        if (f.line in noqa and codes is None) or (codes and f.code in codes):
            continue
        if (f.line, f.col, f.code) not in seen:
            seen.add((f.line, f.col, f.code))
            out.append(f)
    return out


def lint_paths(
    paths: list[str], select: set[str] | None = None, ignore: set[str] | None = None
) -> list[LintFinding]:
    """Lint files and directories (walked recursively for *.py).

    Args:
        paths: Files and directories.
        select: Only these rule codes (all when None).
        ignore: Never these rule codes.

    Raises:
        AuditInputError: a path is missing, not Python, unreadable or does not parse.
    """
    if not paths:
        raise AuditInputError("no paths given")
    out = []
    for path in iter_python_files(paths):
        for f in lint_source(read_python(path), path):
            if (select is None or f.code in select) and not (ignore and f.code in ignore):
                out.append(f)
    return out
