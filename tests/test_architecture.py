"""The shape of the code: no import circle anywhere in src/nanguard, no module reaching into
another's private names or writing another's private attributes, and adapters reach the Guard
through its public face only.

Imports are read from the source (module level, `TYPE_CHECKING` blocks and imports inside
functions alike: a lazy import still ties two modules together), so a circle shows here before
it shows as an ImportError at some import order.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "nanguard"


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_src() -> None:
    assert _cycles(_graph()) == []


def test_the_checker_sees_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(name: str, source: str, mods: set[str]) -> list[str]:
    """Where module `name` uses another nanguard module's private name: `from m import _x`
    (parenthesised lists included), an import of a private module (`m._common`), or
    `m._x` on a module it imported. `nanguard._version` is the package's own version file."""
    found: list[str] = []
    imported: dict[str, str] = {}  # local name -> nanguard module
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if not node.module.startswith("nanguard") or node.module == name:
                continue
            if node.module != "nanguard._version" and any(map(_private, node.module.split("."))):
                found.append(f"{node.lineno}: private module {node.module}")
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in mods:
                    imported[alias.asname or alias.name] = full
                if _private(alias.name) and full != "nanguard._version":
                    found.append(f"{node.lineno}: {full}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("nanguard") and alias.name != name:
                    if any(map(_private, alias.name.split("."))):
                        found.append(f"{node.lineno}: private module {alias.name}")
                    if alias.asname:
                        imported[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in imported and _private(node.attr)):
            found.append(f"{node.lineno}: {imported[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names() -> None:
    mods = _modules()
    offenders = [f"{name}:{use}" for name, path in sorted(mods.items())
                 for use in _private_uses(name, path.read_text(), set(mods))]
    assert offenders == []


def test_the_private_check_sees_each_form() -> None:
    mods = {"nanguard.a", "nanguard.b", "nanguard.c._inner"}
    source = (
        "from nanguard.a import (\n    public,\n    _hidden,\n)\n"
        "from nanguard import b\n"
        "from nanguard.c._inner import thing\n"
        "from nanguard._version import __version__\n"
        "def f():\n    return b._secret, b.shown\n"
    )
    assert _private_uses("nanguard.z", source, mods) == [
        "1: nanguard.a._hidden", "6: private module nanguard.c._inner", "9: nanguard.b._secret"]
    # A module's own private names are its own business.
    assert _private_uses("nanguard.a", "from nanguard.a import _hidden\n", mods) == []


def _assigned(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> list[ast.expr]:
    """The targets `node` assigns, tuples and starred targets unpacked."""
    todo = list(node.targets) if isinstance(node, ast.Assign) else [node.target]
    out: list[ast.expr] = []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo.extend(t.elts)
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _foreign_private_writes(source: str) -> list[str]:
    """Where a module assigns `obj._x = ...` for a private attribute no class of its own
    declares or sets on `self`: it writes another module's object's internals (which should
    be a constructor input or a method of the owner). Patching a stdlib module's attribute
    (`os._exit`, the runner's hard exit) and nanguard's own `_nanguard*` markers on foreign
    objects are not that."""
    tree = ast.parse(source)
    own: set[str] = set()
    stdlib = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
              for a in n.names if not a.name.startswith("nanguard")}
    writes: list[tuple[int, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    own.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    own.update(t.id for t in item.targets if isinstance(t, ast.Name))
        if not isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            continue
        for t in _assigned(node):
            if not (isinstance(t, ast.Attribute) and _private(t.attr)):
                continue
            base = t.value.id if isinstance(t.value, ast.Name) else None
            if base in ("self", "cls"):
                own.add(t.attr)
            elif base not in stdlib and not t.attr.startswith("_nanguard"):
                writes.append((node.lineno, t.attr, ast.unparse(t)))
    return [f"{line}: {text}" for line, attr, text in sorted(writes) if attr not in own]


def test_no_module_writes_another_modules_private_attributes() -> None:
    offenders = [f"{name}:{w}" for name, path in sorted(_modules().items())
                 for w in _foreign_private_writes(path.read_text())]
    assert offenders == []


def test_the_private_write_check_sees_each_form() -> None:
    source = (
        "import os\n"
        "class Mine:\n    _declared: int\n    def __init__(self):\n        self._set = 0\n"
        "def f(a, b, stats):\n"
        "    a._set = b._declared = 1\n"  # its own classes' attributes: fine
        "    stats._signals = None\n"
        "    a.x, (b._cache, c) = 1, (2, 3)\n"
        "    os._exit = print\n"
        "    a._nanguard_own = True\n"
    )
    assert _foreign_private_writes(source) == ["8: stats._signals", "9: b._cache"]


def test_only_the_guard_and_adapters_import_the_guard() -> None:
    """The core (watch, detect, policy, recover, record, pinpoint, explain, show, and the
    step pipeline the Guard holds) never imports the Guard: it gets plain inputs, a narrow
    link or callbacks."""
    graph = _graph()
    users = sorted(m for m, deps in graph.items() if "nanguard.guard" in deps)
    core = ("watch", "detect", "policy", "recover", "record", "pinpoint", "explain", "show",
            "step")
    assert not [m for m in users if (m.split(".") + [""])[1] in core], users


def test_adapters_use_the_guards_public_face() -> None:
    """No `guard._private` access from the integrations, the runner or the CLI."""
    private = re.compile(r"\bguard\._[a-z]\w*")
    offenders = []
    for folder in ("integrations", "run", "cli"):
        for f in (SRC / folder).rglob("*.py"):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if private.search(line):
                    offenders.append(f"{f.name}:{i}: {line.strip()}")
    assert offenders == []
