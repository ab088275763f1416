"""Divergence: the loss climbs and stays far above its recent level."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Norms
from nanguard.detect.series import LEVEL_MIN_STEPS, SeriesDetector, robust_z
from nanguard.watch.stats import StepStats

_isfinite = math.isfinite


class DivergenceDetector(SeriesDetector):
    """The loss climbs and stays far above its recent level (z-score, ratio to the median, and
    an absolute rise of at least `level_floor` of the highest typical loss of the run)."""

    signals = ("loss",)
    phase = "pre"  # the loss alone: judged before the update where the step is read then (a
    # policy acting on it, a replay armed, a hand-written update whose end comes only at the
    # next forward, after the script's own logging)

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        self.recent: deque[float] = deque(maxlen=config.divergence_steps)
        self.first: float | None = None  # the run's first finite loss: its initial scale
        # A non-stationary objective (on-policy RL, a GAN: `detect.objective`): the loss
        # moves without anything going wrong; the windows still follow it, nothing fires.
        self.nonstationary = False

    def _early(self, stats: StepStats, x: float) -> list[Alarm] | None:
        """Before the statistics have history: the loss and the one before it both at least
        `early_loss_ratio` x the run's first loss. The floor is the loss's own initial scale
        (the loss at initialization: divergence may start with the very next step), not its
        recent median: a GAN discriminator's 0.001 -> 0.01 is 10x its median, yet far below
        the ~1.4 it started from. None: no verdict."""
        if self.first is None or len(self.recent) < 2:
            return None
        base = self.first
        limit = self.config.early_loss_ratio * base
        if base <= 0 or min(list(self.recent)[-2:]) < limit:
            return None
        return self._fire(
            stats, "divergence", "loss", x,
            f"loss {x:.4g} is {x / base:.3g}x the run's first loss ({base:.4g}), two steps in "
            "a row: early divergence")

    def check(self, stats: StepStats) -> list[Alarm]:
        x = stats.loss
        if x is None or not math.isfinite(x):
            return []
        self.recent.append(x)
        hist = self.history["loss"]
        alarms: list[Alarm] = []
        diverging = False
        need = max(self.config.warmup_steps, 2 * self.config.divergence_steps)
        if self.nonstationary:
            if self.first is None:
                self.first = x
            if len(hist) >= need and len(self.recent) == self.recent.maxlen:
                self._note_level("loss", hist.median())
            hist.append(x)
            return []
        early_regime = len(hist) < need
        if early_regime and (early := self._early(stats, x)) is not None:
            return early  # not added to the history: a divergence never becomes the baseline
        if self.first is None:
            self.first = x
        if (
            len(hist) >= max(self.config.warmup_steps, 2 * self.config.divergence_steps)
            and len(self.recent) == self.recent.maxlen
        ):
            mean_recent = sum(self.recent) / len(self.recent)
            med = hist.median()
            self._note_level("loss", med)
            # Sustained: every recent step is far above the median, not one outlier batch.
            ratio_ok = med > 0 and min(self.recent) >= self.config.divergence_ratio * med
            # ...and by an amount that matters on the loss's own scale: a GAN discriminator's
            # 0.001 -> 0.004 is 4x, yet far below the ~1.4 it started from (no divergence).
            floor_ok = mean_recent - med >= self.config.level_floor * self.peak.get("loss", 0.0)
            # The z-score (its MAD sorts the window) only matters once both cheap tests passed.
            if (
                ratio_ok
                and floor_ok
                and robust_z(mean_recent, hist, floor=1e-3 * max(abs(med), 1e-8))[0]
                >= self.config.spike_z
            ):
                diverging = True
                alarms = self._fire(
                    stats,
                    "divergence",
                    "loss",
                    mean_recent,
                    f"loss averages {mean_recent:.4g} over the last {len(self.recent)} steps, "
                    f"{mean_recent / med:.3g}x its recent median {med:.4g}",
                )
        if not diverging:
            hist.append(x)
        return alarms

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (`detect.base`): no divergence is possible while, with this loss
        among the recent ones, the latest two are under `early_loss_ratio` x the first loss
        (before the statistics have history) or not every recent loss is `divergence_ratio` x
        the median (after), or the loss-trend tests are off. Then: the recent losses, the
        first one and the level as `check` leaves them, the loss appended."""
        loss = stats.loss
        if loss is None or not _isfinite(loss):
            return []
        cfg = self.config
        recent = self.recent
        m = recent.maxlen
        new = [*recent, loss][-m:] if m else []  # the recent losses as `check` will see them
        hist = self.history["loss"]
        n = len(hist)
        level = None
        if n < max(cfg.warmup_steps, 2 * cfg.divergence_steps):
            first = self.first  # `_early`'s test
            if (not self.nonstationary and first is not None and len(new) >= 2 and first > 0
                    and min(new[-2:]) >= cfg.early_loss_ratio * first):
                return None
        elif len(new) == m:
            med = hist.mid
            if not self.nonstationary and med > 0 and min(new) >= cfg.divergence_ratio * med:
                return None
            level = med
        recent.append(loss)
        if self.first is None:
            self.first = loss
        if level is not None and n >= LEVEL_MIN_STEPS:  # `_note_level`, inline
            self.peak["loss"] = max(self.peak.get("loss", level), level)
        return [(hist, loss, None, "")]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "recent": list(self.recent), "first": self.first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.recent = deque(state["recent"], maxlen=self.config.divergence_steps)
        first = state.get("first")
        self.first = None if first is None else float(first)
