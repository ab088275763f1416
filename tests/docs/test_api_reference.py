"""The Python API reference covers every public name the README and the docs use.

Every `nanguard.X.Y` the pages name (in prose, code or `from nanguard.X import Y`) must be a
real object, and docs/reference/ must render it: a `::: name` directive for it, for the module
that holds it, or for the class it is a member of. A page that starts using a new name fails
here until the reference shows it.
"""

from __future__ import annotations

import importlib
import re
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))

import doc_blocks as blocks  # noqa: E402

_DOTTED = re.compile(r"(?<![\w./-])nanguard(?:\.[A-Za-z_]\w*)+")
_FROM = re.compile(r"from (nanguard(?:\.\w+)*) import ([\w, ()]+)")
_DIRECTIVE = re.compile(r"^::: (nanguard[\w.]*)\s*$", re.M)
# Dotted words on the pages that are not Python names (tracker tag names, file names).
NOT_API = {"nanguard.event"}


def used_names() -> dict[str, str]:
    """Each dotted nanguard name a page uses, and the first page using it."""
    found: dict[str, str] = {}
    for page in blocks.pages():
        text = page.read_text()
        names = set(_DOTTED.findall(text))
        for module, imported in _FROM.findall(text):
            names |= {f"{module}.{n.strip('() ')}" for n in imported.split(",") if n.strip("() ")}
        for name in sorted(names):
            found.setdefault(name, str(page.relative_to(ROOT)))
    return found


def resolve(name: str) -> object:
    """The object a dotted name means, importing modules on the way."""
    parts = name.split(".")
    obj: object = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def documented() -> set[str]:
    return {m for page in (ROOT / "docs" / "reference").glob("*.md")
            for m in _DIRECTIVE.findall(page.read_text())}


def canonical(name: str) -> str:
    """Where an object is defined (`nanguard.config.DetectConfig` for `nanguard.DetectConfig`),
    so a name and its re-export count as one."""
    obj = resolve(name)
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else name


def covered(name: str, directives: set[str]) -> bool:
    """A name is shown by its own directive, by a directive of a module or class holding it,
    or (a package) by directives of what it holds."""
    for candidate in {name, canonical(name)}:
        if candidate in directives or any(candidate.startswith(d + ".") for d in directives):
            return True
        if any(d.startswith(candidate + ".") for d in directives):
            return True
    return False


def test_pages_use_names_that_exist() -> None:
    missing = []
    for name, page in used_names().items():
        if name in NOT_API:
            continue
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{page}: {name} ({exc})")
    assert not missing, "\n".join(missing)


def test_reference_documents_every_name_the_pages_use() -> None:
    directives = documented()
    directives |= {canonical(d) for d in directives}
    names = {n: p for n, p in used_names().items() if n not in NOT_API}
    assert len(names) >= 10  # the pages do use the API: the scan found it
    undocumented = [f"{page}: {name}" for name, page in names.items()
                    if not covered(name, directives)]
    assert not undocumented, ("add these to docs/reference/api.md:\n" + "\n".join(undocumented))
