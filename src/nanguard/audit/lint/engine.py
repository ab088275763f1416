"""The lint engine: parse a file, resolve import aliases and simple local assignments, run the
rules' context, honour ``# noqa``. The rules themselves live in `rules.py`, and `check.py`
runs them over sources and paths.

Resolution is deliberately shallow (no control flow, no type inference): a name resolves to
its latest plain assignment above the use in the same function, else at module level; an
attribute ``self.x`` resolves to an assignment ``self.x = ...`` anywhere in the class. That
is enough to see ``p = torch.sigmoid(z); F.binary_cross_entropy(p, y)`` and
``self.crit = nn.BCELoss()`` without guessing about anything less direct.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from nanguard.audit.common import AuditInputError, json_safe

_NOQA = re.compile(r"#\s*noqa(?::\s*(?P<codes>[A-Z]+\d+(?:[\s,]+[A-Z]+\d+)*))?", re.IGNORECASE)
# Aliases a script commonly uses without importing them the usual way (e.g. in notebooks).
_DEFAULT_ALIASES = {"F": "torch.nn.functional", "nn": "torch.nn", "torch": "torch"}
_SKIP_DIRS = {".git", ".hg", ".venv", "venv", "__pycache__", "node_modules", "build", "dist",
              ".tox", ".mypy_cache", ".ruff_cache", ".pytest_cache"}  # fmt: skip


@dataclass(kw_only=True)
class LintFinding:
    """One rule violation. `line` and `col` are 1-based, like other linters."""

    path: str
    line: int
    col: int
    code: str
    message: str
    fix: str

    def format(self) -> str:
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message} (fix: {self.fix})"

    def to_dict(self) -> dict[str, Any]:
        return json_safe({k: getattr(self, k) for k in self.__dataclass_fields__})


class Context:
    """What the rules may ask about a parsed module."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree, self.path = tree, path
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.aliases = dict(_DEFAULT_ALIASES)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        self.aliases[root] = root
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        # scope node -> name -> [(line, value)]; class node -> attribute -> value
        self.assigns: dict[ast.AST, dict[str, list[tuple[int, ast.expr]]]] = {}
        self.attrs: dict[ast.AST, dict[str, ast.expr]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                self._record(node.targets[0], node.value, node.lineno)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                self._record(node.target, node.value, node.lineno)
        self.findings: list[LintFinding] = []

    def _record(self, target: ast.expr, value: ast.expr, line: int) -> None:
        if isinstance(target, ast.Name):
            scope = self.scope_of(target)
            self.assigns.setdefault(scope, {}).setdefault(target.id, []).append((line, value))
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            cls = self.enclosing(target, ast.ClassDef)
            if cls is not None:
                self.attrs.setdefault(cls, {})[target.attr] = value

    def enclosing(self, node: ast.AST, kinds: Any) -> Any:
        cur = self.parent.get(node)
        while cur is not None and not isinstance(cur, kinds):
            cur = self.parent.get(cur)
        return cur

    def scope_of(self, node: ast.AST) -> ast.AST:
        return (
            self.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or self.tree
        )

    def resolve(self, expr: ast.expr, depth: int = 0) -> ast.expr:
        """Follow a name or ``self.attr`` to the expression assigned to it, if plainly visible."""
        if depth > 4:
            return expr
        if isinstance(expr, ast.Name):
            for scope in (self.scope_of(expr), self.tree):
                found = [
                    (line, v)
                    for line, v in self.assigns.get(scope, {}).get(expr.id, [])
                    if line < expr.lineno or scope is not self.scope_of(expr)
                ]
                if found:
                    value = max(found, key=lambda lv: lv[0])[1]
                    return value if value is expr else self.resolve(value, depth + 1)
        elif (
            isinstance(expr, ast.Attribute)
            and isinstance(expr.value, ast.Name)
            and expr.value.id == "self"
        ):
            cls = self.enclosing(expr, ast.ClassDef)
            attr = self.attrs.get(cls, {}).get(expr.attr) if cls is not None else None
            if attr is not None:
                return self.resolve(attr, depth + 1)
        return expr

    def qualname(self, expr: ast.expr) -> str:
        """Dotted name, import alias expanded: ``F.relu`` -> ``torch.nn.functional.relu``."""
        parts: list[str] = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return ""
        parts.append(self.aliases.get(expr.id, expr.id))
        return ".".join(reversed(parts))

    def is_module_path(self, expr: ast.expr) -> bool:
        """True for ``torch``, ``torch.nn.functional``, ``np``: an imported module, not a value."""
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        return isinstance(expr, ast.Name) and expr.id in self.aliases

    def report(self, node: ast.AST, code: str, message: str, fix: str) -> None:
        line, col = getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1
        self.findings.append(
            LintFinding(path=self.path, line=line, col=col, code=code, message=message, fix=fix)
        )


def noqa_lines(source: str) -> dict[int, set[str] | None]:
    """Line -> suppressed codes (None: everything) from ``# noqa`` comments (real comments
    only, found with tokenize, so a string containing '# noqa' does not count)."""
    out: dict[int, set[str] | None] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                m = _NOQA.search(tok.string)
                if m:
                    codes = m.group("codes")
                    out[tok.start[0]] = (
                        {c.upper() for c in re.split(r"[\s,]+", codes) if c} if codes else None
                    )
    except (tokenize.TokenError, SyntaxError):
        pass  # ast.parse already accepted the file; a tokenizer quirk only loses noqa
    return out


def read_python(path: str) -> str:
    """Source text of a .py file, honouring a PEP 263 coding cookie."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except IsADirectoryError:
        raise AuditInputError(f"{path}: is a directory") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
        return data.decode(encoding)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise AuditInputError(
            f"{path}: cannot decode as UTF-8 or its declared encoding ({exc})"
        ) from None


def iter_python_files(paths: list[str]) -> Iterator[str]:
    """Files to lint: explicit .py files, and *.py found recursively under directories."""
    for path in paths:
        if not os.path.exists(path):
            raise AuditInputError(f"{path}: no such file or directory")
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
                for name in sorted(files):
                    if name.endswith(".py"):
                        yield os.path.join(root, name)
        elif path.endswith((".py", ".pyi")):
            yield path
        else:
            raise AuditInputError(f"{path}: not a Python file (expected .py or a directory)")
