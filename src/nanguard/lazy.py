"""Lazy public names for a package (PEP 562): each is imported from its module on first use.

`nanguard` and `nanguard.audit` keep their import cheap this way (the CLI's parser, a script's
`import nanguard`), while `from nanguard import Guard` and `dir()` work as for eager names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, table: dict[str, str], namespace: dict[str, Any],
               public: list[str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level `__getattr__` and `__dir__` of `package`: `table` maps a public name to
    the module that defines it; a name is kept in `namespace` (the package's globals) once
    imported, so the module is imported once; `public` is the package's `__all__`."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *public})

    return __getattr__, __dir__
