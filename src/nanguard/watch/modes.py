"""Leaving a torch mode that a probe entered, without ever raising into training."""

from __future__ import annotations

from typing import Any


def leave(mode: Any) -> bool:
    """Exit `mode` (a `TorchDispatchMode` or `TorchFunctionMode` a probe entered). Returns
    False when torch refused: another mode entered after it is still active, so leaving would
    be out of order; the caller then stands its probe down for good (a monitor never breaks
    training)."""
    try:
        mode.__exit__(None, None, None)
    except Exception:  # noqa: BLE001 - a monitor never breaks training
        return False
    return True
