"""Adaptive gradient clipping on a z-score of the grad norm, safe against non-finite norms.

Like ZClip: an EMA of the grad norm's mean and variance; a norm above mean + z * std is scaled
down to that threshold. Unlike ZClip, a non-finite norm never enters the statistics (one NaN
would poison the EMA for good): the step is skipped instead, and the statistics stay clean.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from nanguard.config import ClipConfig


class AdaptiveClipper:
    """Args:
    config: z threshold, EMA factor and warm-up.
    """

    def __init__(self, config: ClipConfig) -> None:
        self.config = config
        self.mean = 0.0
        self.var = 0.0
        self.count = 0

    def threshold(self) -> float | None:
        """The norm above which gradients are clipped; None during warm-up."""
        if self.count < self.config.warmup_steps:
            return None
        return self.mean + self.config.z * math.sqrt(max(self.var, 0.0))

    def decide(self, norm: float) -> tuple[str, float]:
        """("skip", nan) for a non-finite norm, ("clip", scale) above the threshold, else
        ("keep", 1.0). Updates the statistics with the (clipped) finite norm."""
        if not math.isfinite(norm):
            return "skip", math.nan
        limit = self.threshold()
        action, scale, seen = "keep", 1.0, norm
        if limit is not None and norm > limit > 0:
            action, scale, seen = "clip", limit / norm, limit
        self._update(seen)
        return action, scale

    def _update(self, x: float) -> None:
        ema_update(self, x, self.config.ema, self.config.warmup_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean, self.var, self.count = (
            float(state["mean"]),
            float(state["var"]),
            int(state["count"]),
        )


class _Running(Protocol):
    mean: float
    var: float
    count: int


def ema_update(stats: _Running, x: float, ema: float, warmup: int) -> None:
    """Fold `x` into running `mean`/`var`/`count`: exact running moments for the first
    `warmup` values (1/n weights), an exponential moving average with weight `ema` after."""
    stats.count += 1
    if stats.count == 1:
        stats.mean, stats.var = x, 0.0
        return
    a = ema if stats.count > warmup else 1.0 / stats.count
    delta = x - stats.mean
    stats.mean += a * delta
    stats.var = (1 - a) * (stats.var + a * delta * delta)
