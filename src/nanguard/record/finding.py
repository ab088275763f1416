"""The first non-finite finding of a run: where the first NaN/Inf showed, typed.

report.json's `first_nonfinite` is this object's `to_dict()`. The watched signals give the
core fields (`detect.locate`); a replay (`pinpoint`) or loaded-state check adds more (op inputs,
the autograd node, the loaded tensors, a verdict, ...), kept in `extra` as plain JSON data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_CORE = ("step", "phase", "module", "op", "source", "samples", "rank", "signals", "param")


@dataclass(kw_only=True)
class Finding:
    """Where the first non-finite value of the run appeared."""

    step: int
    """The 0-based optimizer step where it showed."""
    phase: str | None = None
    """data, forward, loss, backward, optimizer or checkpoint; None when nothing placed it."""
    module: str | None = None
    """The module it showed in (`model.named_modules()` name), when known."""
    op: str | None = None
    """The aten op that produced it (after a replay), e.g. `aten.sqrt`."""
    source: str | None = None
    """file:line of the user's code that ran the op (or loaded the value)."""
    samples: list[int] = field(default_factory=list)
    """Rows of the step's batch that carry it."""
    rank: int | None = None
    """The rank where it appeared."""
    signals: list[str] = field(default_factory=list)
    """The watched signals that were non-finite at that step."""
    param: str | None = None
    """The parameter whose gradient or value went non-finite first, when one did."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Everything else a replay or the loaded-state check found (report.json keys as-is)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Finding:
        """A finding from a `first_nonfinite` dict (unknown keys go to `extra`)."""
        core = {k: data[k] for k in _CORE if k in data}
        core.setdefault("step", 0)
        for k in ("samples", "signals"):
            if core.get(k) is None:
                core[k] = []
        return cls(**core, extra={k: v for k, v in data.items() if k not in _CORE})

    def to_dict(self) -> dict[str, Any]:
        """report.json's `first_nonfinite` (a fresh dict; changing it changes nothing here)."""
        return {"step": self.step, "phase": self.phase, "module": self.module, "op": self.op,
                "source": self.source, "samples": list(self.samples), "rank": self.rank,
                "signals": list(self.signals), "param": self.param, **self.extra}

    def update(self, values: Mapping[str, Any]) -> None:
        """Merge `values` in, as `dict.update` would on `to_dict()`."""
        for k, v in values.items():
            if k in _CORE:
                setattr(self, k, list(v) if k in ("samples", "signals") and v is not None else v)
            else:
                self.extra[k] = v

    def get(self, key: str, default: Any = None) -> Any:
        """A field or `extra` key by its report.json name."""
        if key in _CORE:
            return getattr(self, key)
        return self.extra.get(key, default)
