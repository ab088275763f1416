"""Series detectors' shared machinery: windows of healthy values and their typical levels.

`Window` keeps a bounded window sorted as well, so its median is an attribute; `absorb` is the
one way values enter windows (`Window.append` is `absorb` of one value), in one call for all
the appends a quiet step makes. `SeriesDetector` is the base of the detectors that judge a
signal against its own recent history. Histories keep healthy values only: a spike or a NaN
never becomes the baseline.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from statistics import median
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.base import Append, Detector

LEVEL_MIN_STEPS = 5
"""Healthy steps of history before a signal's median counts as a typical level (see
`SeriesDetector.peak`)."""


def _middle(s: list[float]) -> float:
    """`statistics.median`'s expression on a sorted list; NaN when empty."""
    n = len(s)
    if not n:
        return math.nan
    i = n // 2
    return s[i] if n % 2 else (s[i - 1] + s[i]) / 2


class Window(deque[float]):
    """A bounded window of healthy values that also keeps them sorted, and their median.

    The detectors look up the window's median (and max) every step; `statistics.median` sorted
    the 100 values again at each lookup. Here an append costs one binary search plus a memmove
    of at most `maxlen` pointers, and the median (`mid`) is kept. The sorted list holds the
    very objects of the deque, in deque order among equal values (as a stable sort of the deque
    would), so every lookup returns what `median(self)` returned. Only `append`, `extend` and
    `clear` keep them in step: the detectors use nothing else.

    Attributes:
        sorted: the values, sorted.
        mid: their median (`statistics.median`), NaN when empty.
    """

    def __init__(self, values: Iterable[float] = (), maxlen: int | None = None) -> None:
        super().__init__(values, maxlen)
        self.sorted: list[float] = sorted(self)
        self.mid: float = _middle(self.sorted)

    def append(self, x: float) -> None:
        absorb(((self, x, None, ""),))

    def extend(self, values: Iterable[float]) -> None:
        absorb([(self, v, None, "") for v in values])

    def clear(self) -> None:
        super().clear()
        self.sorted.clear()
        self.mid = math.nan

    def median(self) -> float:
        """`statistics.median(self)`, without sorting (the same expression on the same list)."""
        if not self:
            raise ValueError("no median for an empty window")
        return self.mid

    def largest(self) -> float:
        return self.sorted[-1]

    def __reduce__(self) -> Any:
        # Copies and pickles rebuild from the values (the sorted list follows).
        return (type(self), (list(self), self.maxlen))


def absorb(appends: Iterable[Append]) -> None:
    """Append each value to its window, in order; where a levels dict is given, note the
    window's new median there as a typical level of the key (`SeriesDetector._note_level`).

    The one implementation of `Window.append`: a quiet step's appends, left by the quiet updates
    of every detector, take one call here (not one per window).
    """
    for w, x, levels, key in appends:
        s = w.sorted
        if len(s) == w.maxlen:  # full (never, without a maxlen): the oldest value leaves
            if not s:
                continue  # a window of length 0 keeps nothing
            old = w[0]
            i = bisect_left(s, old)
            # The oldest of the equal values is the object leaving: equal floats may differ
            # (0.0 and -0.0), so find that very object, not just an equal one.
            if i == len(s) or s[i] is not old:
                i = _index_of(s, old, i)
            del s[i]
        deque.append(w, x)
        insort(s, x)  # after its equals: the newest last, as in the deque
        n = len(s)
        i = n // 2
        mid = w.mid = s[i] if n % 2 else (s[i - 1] + s[i]) / 2
        if levels is not None and n >= LEVEL_MIN_STEPS:
            levels[key] = max(levels.get(key, mid), mid)


def _index_of(s: list[float], old: float, i: int) -> int:
    """Where the object `old` sits in `s`, from `i` on (after equal values that are other
    objects), else anywhere: a NaN loaded from a foreign state breaks the order."""
    while i < len(s) and s[i] is not old:
        i += 1
    return i if i < len(s) else next(k for k, v in enumerate(s) if v is old)


def robust_z(x: float, history: Window, floor: float) -> tuple[float, float]:
    """Robust z-score of `x` against `history`: (x - median) / (1.4826 MAD), MAD floored.

    The MAD sorts the deviations: callers ask for it only when a cheaper test (ratio to the
    median, level) already passed, which a healthy step almost never does.
    """
    med = history.median()
    mad = median(abs(v - med) for v in history.sorted)
    return (x - med) / max(1.4826 * mad, floor), med


class SeriesDetector(Detector):
    """Shared machinery: a window of recent healthy values per signal, and its levels."""

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

    def take_baselines(self, other: SeriesDetector) -> None:
        """Start from `other`'s windows of healthy values and typical levels (a detector of the
        same class watching the same parameters under another optimizer): its medians and
        warm-up carry over; cooldowns and runs in progress do not (they count steps)."""
        assert type(other) is type(self)
        for k, w in other.history.items():
            if k in self.history:
                self.history[k] = Window(list(w), maxlen=self.config.window)
        self.peak = dict(other.peak)

    def _note_level(self, signal: str, med: float) -> None:
        """Note `med`, the recent median of `signal` in linear units, as a typical level.
        (Quiet updates write this inline, or leave it to `absorb`: no call per note.)"""
        if len(self.history[signal]) >= LEVEL_MIN_STEPS:
            self.peak[signal] = max(self.peak.get(signal, med), med)

    def _reaches_level(self, signal: str, x: float) -> bool:
        """Is `x` within `level_floor` of the highest typical level? A jump that stays far below
        the run's normal scale (a converged model's rare hard sample) is not an instability."""
        return x >= self.config.level_floor * self.peak.get(signal, 0.0)

    @staticmethod
    def value(stats: Any, signal: str) -> float | None:
        """The value of `signal` judged on this step (the grad norm before the script's own
        clip where it clipped: `StepStats.judged_grad_norm`)."""
        v = getattr(stats, "judged_grad_norm" if signal == "grad_norm" else signal)
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
