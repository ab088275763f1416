"""Cascades: consecutive multiplicative growth that has left the signal's normal range."""

from __future__ import annotations

import math
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Norms
from nanguard.detect.series import LEVEL_MIN_STEPS, SeriesDetector, Window
from nanguard.watch.stats import StepStats

_isfinite = math.isfinite


class CascadeDetector(SeriesDetector):
    """Consecutive multiplicative growth that has left the signal's normal range."""

    signals = ("grad_norm", "act_max", "momentum_norm")

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        self.run: dict[str, int] = {s: 0 for s in self.signals}
        self.prev: dict[str, float] = {}
        self.start: dict[str, float] = {}  # the value the current run of growth started from
        # Every finite value of the last `window` steps, growth steps included: the range the
        # signal has visited. A cascade runs away out of it; a heavy-tailed but stationary
        # signal (a deep residual stack's grad norm swinging 15 -> 340 -> 15) climbs 3 steps
        # in a row to 7x its median inside it, and that is no cascade.
        self.seen: dict[str, Window] = {s: Window(maxlen=config.window) for s in self.signals}

    def check(self, stats: StepStats) -> list[Alarm]:
        alarms: list[Alarm] = []
        for signal in self.signals:
            x = self.value(stats, signal)
            if x is None:
                continue  # not measured this step (sampled activations): no news, no reset
            if not math.isfinite(x) or x <= 0:
                self.run[signal] = 0
                continue
            prev = self.prev.get(signal)
            grew = prev is not None and x >= prev * self.config.cascade_growth
            self.run[signal] = self.run[signal] + 1 if grew else 0
            if self.run[signal] == 1 and prev is not None:
                self.start[signal] = prev
            self.prev[signal] = x
            hist = self.history[signal]
            if self.run[signal] == 0:
                hist.append(x)
            seen = self.seen[signal]
            visited = seen.largest() if seen else 0.0
            seen.append(x)
            if not hist:
                continue
            med = hist.median()
            self._note_level(signal, med)
            # An optimizer's moment starts at zero (Adam's exp_avg) and grows by construction
            # over its first ~1/(1 - beta1) steps, whatever the gradients do: before a window
            # of history exists its growth is no evidence. A real early cascade drives the
            # gradients, which the early test still judges.
            early = (signal != "momentum_norm" and len(hist) < self.config.warmup_steps
                     and x >= self.config.early_growth * self.start.get(signal, math.inf))
            if (
                self.run[signal] >= self.config.cascade_steps
                and (len(hist) >= self.config.warmup_steps or early)
                and x >= self.config.cascade_ratio * med
                and x > visited
                and self._reaches_level(signal, x)
            ):
                alarms += self._fire(
                    stats,
                    "cascade",
                    signal,
                    x,
                    f"{signal} grew {self.run[signal]} steps in a row to {x:.3g} "
                    f"({x / med:.3g}x its recent median): amplification cascade",
                )
        return alarms

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (`detect.base`): no cascade is possible while no signal's run of
        growth reaches `cascade_steps`. Then: the runs, their starts and the values as
        `check` leaves them; a value that did not grow appended, and each median noted as a
        level (by `absorb` after the append, as `check` notes it)."""
        acts = stats.activations  # `act_max`, inline (no call)
        values = (norms[0], max(acts.values()) if acts else None, norms[2])
        growth = self.config.cascade_growth
        steps = self.config.cascade_steps
        prevs, runs = self.prev, self.run
        now: list[tuple[str, float, int, float | None]] = []
        for signal, x in zip(self.signals, values, strict=True):
            if x is None:
                continue  # not measured this step: no news, no reset
            x = float(x)
            if not _isfinite(x) or x <= 0:
                now.append((signal, x, -1, None))  # the run ends, nothing else
                continue
            prev = prevs.get(signal)
            run = runs[signal] + 1 if prev is not None and x >= prev * growth else 0
            if run >= steps:
                return None  # a cascade's necessary condition: `check` decides
            now.append((signal, x, run, prev))
        appends: list[Append] = []
        peak, seen = self.peak, self.seen
        for signal, x, run, prev in now:
            if run < 0:
                runs[signal] = 0
                continue
            runs[signal] = run
            appends.append((seen[signal], x, None, ""))
            if run == 1 and prev is not None:
                self.start[signal] = prev
            prevs[signal] = x
            hist = self.history[signal]
            if run == 0:
                appends.append((hist, x, peak, signal))  # noted after the append
            elif len(hist) >= LEVEL_MIN_STEPS:  # `_note_level` of the unchanged window
                med = hist.mid
                peak[signal] = max(peak.get(signal, med), med)
        return appends

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "run": dict(self.run), "prev": dict(self.prev),
                "start": dict(self.start), "seen": {k: list(v) for k, v in self.seen.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.run.update(state["run"])
        self.prev = dict(state["prev"])
        self.start = dict(state.get("start", {}))
        for k, values in state.get("seen", {}).items():  # (absent from older states)
            self.seen[k] = Window(values, maxlen=self.config.window)
