"""The decorator every config dataclass wears: a misspelled field is a one-line ValueError."""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any, TypeVar

_C = TypeVar("_C")


def strict(cls: type[_C]) -> type[_C]:
    """Make a config dataclass reject a misspelled field with a ValueError that lists the
    valid names (the generated `__init__` would raise a bare TypeError)."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; "
                             f"valid fields: {', '.join(names)}")
        init(self, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls
