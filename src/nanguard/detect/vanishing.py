"""Vanishing gradients: tiny against the parameters, for many steps in a row."""

from __future__ import annotations

import math
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Detector, Norms
from nanguard.watch.stats import StepStats

_isfinite = math.isfinite


class VanishingDetector(Detector):
    """Gradients tiny against the parameters for many consecutive steps."""

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        self.count = 0

    def check(self, stats: StepStats) -> list[Alarm]:
        g, p = stats.grad_norm, stats.param_norm
        if not stats.grad_norms or not math.isfinite(g) or not math.isfinite(p) or p <= 0:
            self.count = 0
            return []
        self.count = self.count + 1 if g <= self.config.vanishing_norm * p else 0
        if self.count >= self.config.vanishing_steps:
            return self._fire(
                stats,
                "vanishing",
                "grad_norm",
                g,
                f"grad norm {g:.3g} has been below {self.config.vanishing_norm:g} x param norm "
                f"for {self.count} steps: gradients vanish",
            )
        return []

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (`detect.base`): the count of small steps as `check` leaves it, while
        it stays under `vanishing_steps` (no alarm possible)."""
        g, p = norms[0], norms[1]
        if not stats.grad_norms or not _isfinite(g) or not _isfinite(p) or p <= 0:
            count = 0
        else:
            count = self.count + 1 if g <= self.config.vanishing_norm * p else 0
        if count >= self.config.vanishing_steps:
            return None
        self.count = count
        return []

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.count = int(state["count"])
