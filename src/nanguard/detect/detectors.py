"""Detectors over the per-step series. Each is a small stateful unit with `state_dict`.

A detector sees one `StepStats` at a time, in step order, and returns the alarms it raises.
`phase = "pre"` detectors only need what is known before `optimizer.step()` (loss, gradients,
activations), so a policy can act on them before the update; `"post"` ones need the step done.
Histories keep healthy values only: a spike or a NaN never becomes the baseline.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from itertools import islice
from statistics import median
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.bad_batch import BAD_BATCH, LossOutlier, judge
from nanguard.watch.stats import StepStats

FLOAT32_MAX = 3.4028234663852886e38
# A float32 sum of squares overflows once the norm passes sqrt(float32 max).
FLOAT32_NORM_LIMIT = math.sqrt(FLOAT32_MAX)
# Healthy steps of history before a signal's median counts as a typical level (see `peak`).
LEVEL_MIN_STEPS = 5
# Before `warmup_steps` of history, a spike must also be this many times the largest healthy
# grad norm so far: a healthy run whose gradients climb steadily in its first steps (a GAN's
# discriminator learning, an LR warm-up) never jumps 3x over all its earlier steps at once.
EARLY_OVER_LARGEST = 3.0


def _log10(x: float) -> float:
    return math.log10(x) if x > 0 else -math.inf


class Window(deque[float]):
    """A bounded window of healthy values that also keeps them sorted.

    The detectors look up the window's median (and max) every step; `statistics.median` sorted
    the 100 values again at each lookup, several times per step. Here an append costs one
    binary search plus a memmove of at most `maxlen` pointers, and the median is an index.
    The sorted list holds the very objects of the deque, in deque order among equal values (as
    a stable sort of the deque would), so every lookup returns what `median(self)` returned.
    Only `append`, `extend` and `clear` keep the two in step: the detectors use nothing else.
    """

    def __init__(self, values: Iterable[float] = (), maxlen: int | None = None) -> None:
        super().__init__(values, maxlen)
        self.sorted: list[float] = sorted(self)

    def append(self, x: float) -> None:
        s = self.sorted
        if self.maxlen == 0:
            return
        if self.maxlen is not None and len(self) == self.maxlen:
            old = self[0]
            i = bisect_left(s, old)
            # The oldest of the equal values is the object leaving: equal floats may differ
            # (0.0 and -0.0), so find that very object, not just an equal one.
            while i < len(s) and s[i] is not old:
                i += 1
            if i == len(s):  # a NaN loaded from a foreign state breaks the order: scan
                i = next(k for k, v in enumerate(s) if v is old)
            del s[i]
        super().append(x)
        insort(s, x)  # after its equals: the newest last, as in the deque

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self.append(v)

    def clear(self) -> None:
        super().clear()
        self.sorted.clear()

    def median(self) -> float:
        """`statistics.median(self)`, without sorting (the same expression on the same list)."""
        s = self.sorted
        n = len(s)
        if not n:
            raise ValueError("no median for an empty window")
        i = n // 2
        return s[i] if n % 2 else (s[i - 1] + s[i]) / 2

    def largest(self) -> float:
        return self.sorted[-1]

    def __reduce__(self) -> Any:
        # Copies and pickles rebuild from the values (the sorted list follows).
        return (type(self), (list(self), self.maxlen))


def _robust_z(x: float, history: Window, floor: float) -> tuple[float, float]:
    """Robust z-score of `x` against `history`: (x - median) / (1.4826 MAD), MAD floored.

    The MAD sorts the deviations: callers ask for it only when a cheaper test (ratio to the
    median, level) already passed, which a healthy step almost never does.
    """
    med = history.median()
    mad = median(abs(v - med) for v in history.sorted)
    return (x - med) / max(1.4826 * mad, floor), med


class Detector:
    """Base: a named, stateful, serializable unit."""

    phase = "post"

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.cooldown = config.cooldown
        self._last_fired: dict[tuple[str, str], tuple[int, float]] = {}

    def check(self, stats: StepStats) -> list[Alarm]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fire(
        self,
        stats: StepStats,
        kind: str,
        signal: str,
        value: float,
        msg: str,
        escalates: bool = True,
    ) -> list[Alarm]:
        """Emit one alarm unless the same (kind, signal) fired within the cooldown.

        A new event far more severe than the last one (`value` >= 10x the last fired value, for
        detectors where a larger value is worse) fires even within the cooldown: a spike 1000x
        the median 40 steps after a 20x one is news.
        """
        last = self._last_fired.get((kind, signal))
        escalated = (
            escalates
            and last is not None
            and math.isfinite(value)
            and abs(value) >= 10 * abs(last[1])
        )
        if last is not None and stats.step - last[0] < self.cooldown and not escalated:
            return []
        self._last_fired[(kind, signal)] = (stats.step, value)
        return [Alarm(step=stats.step, kind=kind, signal=signal, value=value, message=msg)]

    def state_dict(self) -> dict[str, Any]:
        return {"last_fired": [[k, s, st, v] for (k, s), (st, v) in self._last_fired.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_fired = {(k, s): (int(st), float(v)) for k, s, st, v in state["last_fired"]}


class NonFiniteDetector(Detector):
    """A NaN or Inf anywhere. Fires at the first step of each non-finite episode per signal.

    Args:
        signals: "pre" watches loss, gradients and activations; "post" watches parameters,
            optimizer state and buffers after the update.
    """

    def __init__(self, config: DetectConfig, signals: str) -> None:
        super().__init__(config)
        self.phase = signals
        self._active: set[str] = set()
        self._unread_warned = False

    def check(self, stats: StepStats) -> list[Alarm]:
        # As sealed by the guard (no copy), else scanned now.
        signals = stats._signals if stats._signals is not None else stats.nonfinite_signals()
        if not signals and not self._active and not stats.overflowed and (
                not stats.unread_nonfinite or self._unread_warned):
            return []  # the quiet step: nothing non-finite now, no episode to end
        wanted = (("data", "loss", "grad", "activation") if self.phase == "pre"
                  else ("param", "optimizer", "buffer"))
        now = {s for s in signals if s.split(".")[0] in wanted}
        alarms = []
        for signal in sorted(now - self._active):
            what = {"grad": f"{len(stats.nonfinite_grads)} gradient tensor(s)"}.get(signal, signal)
            alarms.append(
                Alarm(
                    step=stats.step,
                    kind="nonfinite",
                    signal=signal,
                    value=math.nan,
                    message=f"non-finite value in {what} at step {stats.step}",
                )
            )
        self._active = now
        if self.phase == "post" and stats.unread_nonfinite and not self._unread_warned:
            self._unread_warned = True  # once: it stays non-finite until reset
            names = ", ".join(list(stats.unread_nonfinite.values())[:4])
            alarms.append(Alarm(
                step=stats.step, kind="buffer_nonfinite", signal="buffer", value=math.nan,
                message=f"non-finite {names} at step {stats.step}: BatchNorm running "
                "statistics, which training mode does not read; eval mode will (NaN outputs "
                "there): `module.reset_running_stats()` after the cause is fixed"))
        if self.phase == "pre" and stats.overflowed and "grad" not in now:
            alarms += self._fire(
                stats,
                "overflow",
                "grad_norm",
                stats.grad_norm,
                f"float32 sum of squares of {len(stats.overflowed)} gradient(s) overflowed "
                f"(grad norm {stats.grad_norm:.3g} > {FLOAT32_NORM_LIMIT:.3g}); every element is "
                "still finite, clip_grad_norm_ would return inf",
            )
        return alarms

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "active": sorted(self._active)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._active = set(state["active"])


class _SeriesDetector(Detector):
    """Shared machinery: a window of recent healthy values per signal."""

    signals: tuple[str, ...] = ()

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        self.history: dict[str, Window] = {
            s: Window(maxlen=config.window) for s in self.signals
        }
        # Highest typical (median) level each signal has had: the run's normal scale. Noted from
        # the first few steps on (not after `warmup_steps`): a model that converges within its
        # first 20 steps has already left its normal scale by then.
        self.peak: dict[str, float] = {}

    def take_baselines(self, other: _SeriesDetector) -> None:
        """Start from `other`'s windows of healthy values and typical levels (a detector of the
        same class watching the same parameters under another optimizer): its medians and
        warm-up carry over; cooldowns and runs in progress do not (they count steps)."""
        assert type(other) is type(self)
        for k, w in other.history.items():
            if k in self.history:
                self.history[k] = Window(list(w), maxlen=self.config.window)
        self.peak = dict(other.peak)

    def _note_level(self, signal: str, med: float) -> None:
        """Note `med`, the recent median of `signal` in linear units, as a typical level."""
        if len(self.history[signal]) >= LEVEL_MIN_STEPS:
            self.peak[signal] = max(self.peak.get(signal, med), med)

    def _reaches_level(self, signal: str, x: float) -> bool:
        """Is `x` within `level_floor` of the highest typical level? A jump that stays far below
        the run's normal scale (a converged model's rare hard sample) is not an instability."""
        return x >= self.config.level_floor * self.peak.get(signal, 0.0)

    @staticmethod
    def value(stats: StepStats, signal: str) -> float | None:
        v = getattr(stats, signal)
        return None if v is None else float(v)

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "history": {k: list(v) for k, v in self.history.items()},
            "peak": dict(self.peak),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for k, values in state["history"].items():
            self.history[k] = Window(values, maxlen=self.config.window)
        self.peak = dict(state.get("peak", {}))


def _trend_z(lx: float, hist: Window, k: int, floor: float) -> tuple[float, float]:
    """Trend-robust z-score of `lx` (a log10 value) against `hist`: (z, level).

    The level is the median of the latest `k` values (a slow trend moves it with the run).
    The scale is the larger of two robust deviations, neither of which a slow trend inflates:
    that of the step-to-step changes over the whole window (1.4826 MAD of the differences /
    sqrt(2): the noise of values scattered about a level), and that of the latest `2k` values
    about their least-squares line (a series that wanders like a random walk strays from any
    level by more than one step's change). The window's own MAD, on an initial descent, would
    span the whole descent. Called only once the cheap test passed (it sorts).
    """
    level = recent_level(hist, k)
    diffs = [abs(b - a) for a, b in zip(hist, islice(hist, 1, None), strict=False)]
    steps = 1.4826 * median(diffs) / math.sqrt(2) if diffs else 0.0
    n = len(hist)
    latest = [hist[i] for i in range(max(n - 2 * max(k, 1), 0), n)]
    m = len(latest)
    wander = 0.0
    if m >= 3:
        xm, ym = (m - 1) / 2, sum(latest) / m
        slope = (sum((i - xm) * (y - ym) for i, y in enumerate(latest))
                 / sum((i - xm) ** 2 for i in range(m)))
        wander = 1.4826 * median(abs(y - ym - slope * (i - xm)) for i, y in enumerate(latest))
    return (lx - level) / max(steps, wander, floor), level


def recent_level(hist: Window, k: int) -> float:
    """The median of the latest `k` values of `hist` (not empty): a signal's recent level
    (`statistics.median`'s expression; read from the right end of the deque, in C)."""
    last = sorted(islice(reversed(hist), max(k, 1)))
    i = len(last) // 2
    return last[i] if len(last) % 2 else (last[i - 1] + last[i]) / 2


def trend_jump(lx: float, hist: Window, config: DetectConfig) -> bool:
    """The cheap, necessary condition of `SpikeDetector`'s trend test: enough history and `lx`
    at least `spike_min_ratio` x its recent level (`recent_level`). The quiet gate asks the
    same."""
    n = len(hist)
    if n < config.warmup_steps or not n:
        return False
    jump = math.log10(config.spike_min_ratio)
    if lx - hist.sorted[0] < jump:
        return False  # the level is at least the window's least value: O(1), most steps
    return lx - recent_level(hist, config.spike_level_steps) >= jump


class SpikeDetector(_SeriesDetector):
    """A grad norm or a loss far above its recent history.

    Grad norm: robust z of log10(norm) over the window AND `spike_ratio` x its median (or
    `spike_hard_ratio` x whatever the z). Both signals: `spike_strong_z` trend-robust sigma
    above the recent level and at least `spike_min_ratio` x it (`_trend_z`): a bad batch's
    1.6-3x is far below 10x yet tens of sigma out. The loss test is off on a non-stationary
    objective (`nonstationary`, set by the guard: on-policy RL, a GAN), where a new rollout
    or the other network moves the loss without anything going wrong; the gradient test stays.

    A spike whose batch's own loss is an outlier after a quiet step, at an unchanged LR, is
    named a bad batch (`detect.bad_batch`): its alarms carry `cause="bad_batch"`.
    """

    phase = "pre"
    signals = ("grad_norm", "loss")

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        # A spike is a discrete event, not a state: each new one is news.
        self.cooldown = config.spike_cooldown
        self.nonstationary = False
        self.last_lr: float | None = None  # the LR of the step seen before
        self.last_spike: int | None = None  # the step of the last spike (either signal)

    def check(self, stats: StepStats) -> list[Alarm]:
        grads = self.history["grad_norm"]
        before = grads[-1] if grads else None  # the step before's grad norm, if it was healthy
        alarms, spiked = self._check_grad(stats)
        found, outlier = self._check_loss(stats)
        if spiked or outlier is not None:
            alarms += found
            jump = None  # how far the step before's grad norm stood over its level
            if before is not None:
                jump = 10 ** (before - recent_level(grads, self.config.spike_level_steps))
            cause = judge(stats.step, outlier, lr=stats.lr, last_lr=self.last_lr,
                          last_spike=self.last_spike, before_jump=jump)
            if cause is not None:
                for a in alarms:
                    a.cause = BAD_BATCH
                    a.message += f"; {cause}"
            self.last_spike = stats.step
        self.last_lr = stats.lr
        return alarms

    def _check_grad(self, stats: StepStats) -> tuple[list[Alarm], bool]:
        """The grad norm's tests: (alarms, whether it spiked: an alarm a cooldown silenced
        still keeps the value out of the window)."""
        x = stats.grad_norm
        hist = self.history["grad_norm"]
        if not math.isfinite(x) or x <= 0 or stats.nonfinite_grads:
            return [], False
        lx = math.log10(x)
        cfg = self.config
        alarms: list[Alarm] = []
        is_spike = False
        med = hist.median() if hist else math.nan
        if hist:
            self._note_level("grad_norm", 10 ** med)
        if len(hist) >= cfg.warmup_steps:
            ratio = 10 ** (lx - med)
            # The z-score adapts to noisy histories; a jump of `spike_hard_ratio` x the median
            # is a spike however noisy the history was (unless it stays far below the run's scale).
            # It only matters once the ratio test passed: computed then (its MAD sorts).
            z = math.nan
            if (
                ratio >= cfg.spike_ratio  # the cheap test first: no side effects
                and self._reaches_level("grad_norm", x)
                and ((z := _robust_z(lx, hist, floor=0.05)[0]) >= cfg.spike_z
                     or ratio >= cfg.spike_hard_ratio)
            ):
                is_spike = True
                alarms = self._fire(
                    stats,
                    "spike",
                    "grad_norm",
                    x,
                    f"grad norm {x:.3g} is {ratio:.3g}x its recent median {10**med:.3g} "
                    f"(robust z {z:.1f})",
                )
            elif trend_jump(lx, hist, cfg) and self._reaches_level("grad_norm", x):
                tz, level = _trend_z(lx, hist, cfg.spike_level_steps, floor=1e-3)
                if tz >= cfg.spike_strong_z and lx - level >= math.log10(cfg.spike_min_ratio):
                    is_spike = True
                    alarms = self._fire(
                        stats, "spike", "grad_norm", x,
                        f"grad norm {x:.3g} is {10 ** (lx - level):.3g}x its recent level "
                        f"{10 ** level:.3g} ({tz:.0f} sigma of its step-to-step changes)")
        elif (hist and 10 ** (lx - med) >= cfg.early_spike_ratio
              and 10 ** (lx - hist.largest()) >= EARLY_OVER_LARGEST):
            # Too little history for statistics: only the unmistakable case, a jump far above
            # the typical healthy step so far and well above every one of them (the cascade's
            # opening spike at the end of warm-up). The median, not the largest, is the
            # reference: after a first spike the unstable steps that follow (10x, then 70x,
            # then 10x...) must not become the yardstick the next spike is measured by.
            ratio = 10 ** (lx - med)
            is_spike = True
            alarms = self._fire(
                stats, "spike", "grad_norm", x,
                f"grad norm {x:.3g} is {ratio:.3g}x the median of the {len(hist)} healthy "
                f"step(s) so far ({10 ** med:.3g}; largest "
                f"{10 ** hist.largest():.3g})",
            )
        if not is_spike:
            hist.append(lx)
        return alarms, is_spike

    def _check_loss(self, stats: StepStats) -> tuple[list[Alarm], LossOutlier | None]:
        """The loss's trend test: (alarms, the outlier when the loss spiked)."""
        x = stats.loss
        if x is None or not math.isfinite(x) or x <= 0:
            return [], None
        hist = self.history["loss"]
        lx = math.log10(x)
        cfg = self.config
        if hist:
            self._note_level("loss", 10 ** hist.median())
        if (not self.nonstationary and trend_jump(lx, hist, cfg)
                and self._reaches_level("loss", x)):
            tz, level = _trend_z(lx, hist, cfg.spike_level_steps, floor=1e-3)
            if tz >= cfg.spike_strong_z and lx - level >= math.log10(cfg.spike_min_ratio):
                outlier = LossOutlier(x, 10 ** level, tz)
                return self._fire(
                    stats, "spike", "loss", x,
                    f"loss {x:.4g} is {x / outlier.level:.3g}x its recent level "
                    f"{outlier.level:.4g} ({tz:.0f} sigma of its step-to-step changes)"
                ), outlier
        hist.append(lx)
        return [], None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_lr": self.last_lr, "last_spike": self.last_spike}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_lr = state.get("last_lr")  # absent in states saved before the loss test
        self.last_spike = state.get("last_spike")


class CascadeDetector(_SeriesDetector):
    """Consecutive multiplicative growth that has left the signal's normal range."""

    signals = ("grad_norm", "act_max", "momentum_norm")

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        self.run: dict[str, int] = {s: 0 for s in self.signals}
        self.prev: dict[str, float] = {}
        self.start: dict[str, float] = {}  # the value the current run of growth started from

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
            if not hist:
                continue
            med = hist.median()
            self._note_level(signal, med)
            early = (len(hist) < self.config.warmup_steps
                     and x >= self.config.early_growth * self.start.get(signal, math.inf))
            if (
                self.run[signal] >= self.config.cascade_steps
                and (len(hist) >= self.config.warmup_steps or early)
                and x >= self.config.cascade_ratio * med
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

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "run": dict(self.run), "prev": dict(self.prev),
                "start": dict(self.start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.run.update(state["run"])
        self.prev = dict(state["prev"])
        self.start = dict(state.get("start", {}))


class ForecastDetector(_SeriesDetector):
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


class DivergenceDetector(_SeriesDetector):
    """The loss climbs and stays far above its recent level (z-score, ratio to the median, and
    an absolute rise of at least `level_floor` of the highest typical loss of the run)."""

    signals = ("loss",)

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
                and _robust_z(mean_recent, hist, floor=1e-3 * max(abs(med), 1e-8))[0]
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

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "recent": list(self.recent), "first": self.first}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.recent = deque(state["recent"], maxlen=self.config.divergence_steps)
        first = state.get("first")
        self.first = None if first is None else float(first)


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

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.count = int(state["count"])


def default_detectors(config: DetectConfig, act_limit: float | None = None) -> list[Detector]:
    """The detectors every guard runs, pre-step ones first."""
    limits = {"act_max": act_limit} if act_limit else None
    return [
        NonFiniteDetector(config, "pre"),
        SpikeDetector(config),
        NonFiniteDetector(config, "post"),
        CascadeDetector(config),
        ForecastDetector(config, limits),
        DivergenceDetector(config),
        VanishingDetector(config),
    ]
