"""GradScaler awareness: an fp16 overflow that the scaler skips is counted, never an alarm; a
collapsing scale is.

`GradScaler.step` unscales the gradients before `optimizer.step()` and does not call it at all
when it found an inf, so the guard's hooks only ever see unscaled gradients of steps that
happen. Skipped steps show as a lower scale at the next step the guard sees (each overflow
multiplies it by `backoff_factor`); the scale tensor rides along in the step's single host read.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanguard.config import AmpConfig


class ScalerWatch:
    """Args:
    scaler: the `torch.amp.GradScaler` in use.
    config: collapse thresholds.
    """

    def __init__(self, scaler: Any, config: AmpConfig) -> None:
        self.scaler = scaler
        self.config = config
        self.prev: float | None = None
        self.skipped = 0
        self.halvings = 0  # consecutive decreases without growth
        self.last_collapse: int | None = None  # step of the last collapse alarm (cooldown)

    def scale_tensor(self) -> torch.Tensor | None:
        """The scale, still on its device (None before the scaler's first use)."""
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach().double().reshape(1) if isinstance(scale, torch.Tensor) else None

    def observe(self, scale: float) -> tuple[int, str | None]:
        """Feed the scale read at a step; return (overflow steps skipped since the last one,
        a collapse message or None)."""
        skipped = 0
        if self.prev is not None and scale < self.prev:
            backoff = float(getattr(self.scaler, "_backoff_factor", 0.5)) or 0.5
            skipped = max(1, round(math.log(self.prev / scale) / math.log(1 / backoff)))
            self.halvings += skipped
        elif self.prev is not None and scale > self.prev:
            self.halvings = 0
        self.prev = scale
        self.skipped += skipped
        collapse = None
        if scale < self.config.min_scale or self.halvings >= self.config.max_halvings:
            collapse = (
                f"GradScaler scale collapsed to {scale:.3g} after {self.halvings} "
                "overflow back-offs in a row: gradients overflow float16 at any scale"
            )
        return skipped, collapse

    def state_dict(self) -> dict[str, Any]:
        return {"prev": self.prev, "skipped": self.skipped, "halvings": self.halvings,
                "last_collapse": self.last_collapse}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prev = state["prev"]
        self.skipped = int(state["skipped"])
        self.halvings = int(state["halvings"])
        last = state.get("last_collapse")
        self.last_collapse = None if last is None else int(last)
