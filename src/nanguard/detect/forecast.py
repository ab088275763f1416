"""Forecasts: log-magnitude growth extrapolated to the dtype's largest value, in steps left."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Norms
from nanguard.detect.nonfinite import FLOAT32_MAX, FLOAT32_NORM_LIMIT
from nanguard.detect.series import SeriesDetector
from nanguard.watch.stats import StepStats

_log10 = math.log10
_isfinite = math.isfinite


class ForecastDetector(SeriesDetector):
    """Extrapolates log-magnitude growth to the dtype's largest value: steps left to overflow."""

    signals = ("grad_norm", "act_max", "momentum_norm")

    def __init__(self, config: DetectConfig, limits: dict[str, float] | None = None) -> None:
        super().__init__(config)
        # What "overflow" means per signal: a float32 norm overflows at sqrt(max); activations at
        # their dtype's max (the guard passes the real dtype's limit).
        self.limits = {
            "grad_norm": FLOAT32_NORM_LIMIT,
            "momentum_norm": FLOAT32_NORM_LIMIT,
            "act_max": FLOAT32_MAX,
            **(limits or {}),
        }
        self.recent: dict[str, deque[float]] = {
            s: deque(maxlen=config.cascade_steps + 1) for s in self.signals
        }
        self._log_growth = math.log10(config.cascade_growth)
        # The step of each value in `recent` (a sampled signal skips steps).
        self.at: dict[str, deque[int]] = {
            s: deque(maxlen=config.cascade_steps + 1) for s in self.signals
        }

    def check(self, stats: StepStats) -> list[Alarm]:
        alarms: list[Alarm] = []
        for signal in self.signals:
            x = self.value(stats, signal)
            recent = self.recent[signal]
            if x is None:
                continue  # not measured this step (sampled activations): no news, no reset
            if not math.isfinite(x) or x <= 0:
                recent.clear()
                self.at[signal].clear()
                continue
            recent.append(math.log10(x))
            self.at[signal].append(stats.step)
            hist = self.history[signal]
            step_growth = self._log_growth
            # The newest step first: on a quiet step it did not grow, and that settles it.
            growing = (len(recent) == recent.maxlen
                       and (len(recent) < 2 or recent[-1] - recent[-2] >= step_growth)
                       and all(b - a >= step_growth
                               for a, b in zip(recent, list(recent)[1:], strict=False)))
            if not growing:
                hist.append(x)
                continue
            # Before `warmup_steps` of history only an unmistakable growth is extrapolated.
            early = recent[-1] - recent[0] >= math.log10(self.config.early_growth)
            if (len(hist) < self.config.warmup_steps and not early) or (
                    hist and x < self.config.cascade_ratio * hist.median()):
                continue
            # Per step, not per measurement: sampled signals are measured every N steps.
            at = self.at[signal]
            slope = (recent[-1] - recent[0]) / max(at[-1] - at[0], 1)
            # Activations overflow the dtype they are computed in (float16 under autocast).
            limit = self.limits[signal]
            if signal == "act_max" and stats.act_limit:
                limit = stats.act_limit
            left = (math.log10(limit) - recent[-1]) / slope
            if left <= self.config.forecast_horizon:
                alarms += self._fire(
                    stats,
                    "forecast",
                    signal,
                    left,
                    f"{signal} grows {10**slope:.3g}x per step ({x:.3g} now): overflow of its "
                    f"limit {limit:.3g} in ~{max(left, 0):.1f} steps",
                    escalates=False,
                )
        return alarms

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (`detect.base`): no forecast is possible while no signal's recent
        values, this one included, all grew `cascade_growth` x per step. Then: the recent
        values and their steps as `check` leaves them, each value appended."""
        acts = stats.activations  # `act_max`, inline (no call)
        values = (norms[0], max(acts.values()) if acts else None, norms[2])
        g = self._log_growth
        now: list[tuple[str, float, float | None]] = []
        for signal, x in zip(self.signals, values, strict=True):
            if x is None:
                continue  # not measured this step: no news, no reset
            x = float(x)
            if not _isfinite(x) or x <= 0:
                now.append((signal, x, None))  # the recent values end, nothing else
                continue
            recent = self.recent[signal]
            lx = _log10(x)
            m = recent.maxlen
            if m is None or m < 2:
                return None  # a window of one value always reads as growing
            if len(recent) + 1 >= m and lx - recent[-1] >= g:
                # The newest grew: growing unless an earlier step of the window (as it will be
                # after this value) did not (`check`'s `all`, as a loop: no generator call).
                new = [*recent, lx][-m:]
                for k in range(1, m):
                    if new[k] - new[k - 1] < g:
                        break
                else:
                    return None  # growing: `check` decides
            now.append((signal, x, lx))
        appends: list[Append] = []
        step = stats.step
        for signal, x, logged in now:
            if logged is None:
                self.recent[signal].clear()
                self.at[signal].clear()
                continue
            self.recent[signal].append(logged)
            self.at[signal].append(step)
            appends.append((self.history[signal], x, None, ""))
        return appends

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "recent": {k: list(v) for k, v in self.recent.items()},
                "at": {k: list(v) for k, v in self.at.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        n = self.config.cascade_steps + 1
        for k, values in state["recent"].items():
            self.recent[k] = deque(values, maxlen=n)
            # Older states kept no steps: consecutive ones (what they assumed).
            self.at[k] = deque(state.get("at", {}).get(k, range(len(values))), maxlen=n)
