"""A signal's recent level, and how far a new value stands above it against its trend.

The spike detector's trend test (`SpikeDetector`): a bad batch's loss at 1.6x its level is far
below a 10x spike, yet tens of standard deviations out where the loss's noise is a few %. The
deviation is taken from step-to-step changes, so a slow trend (the initial descent, a growing
grad norm) neither widens the yardstick nor shifts the level.
"""

from __future__ import annotations

import math
from itertools import islice
from statistics import median

from nanguard.config import DetectConfig
from nanguard.detect.series import Window


def trend_z(lx: float, hist: Window, k: int, floor: float) -> tuple[float, float]:
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


def trend_jump(lx: float, hist: Window, config: DetectConfig, ratio: float | None = None
               ) -> bool:
    """The cheap, necessary condition of `SpikeDetector`'s trend test: enough history and `lx`
    at least `ratio` (default `spike_min_ratio`) x its recent level (`recent_level`). Its
    first test is O(1) and settles most steps; the spike detector's quiet update makes it
    before calling."""
    n = len(hist)
    if n < config.warmup_steps or not n:
        return False
    jump = math.log10(config.spike_min_ratio if ratio is None else ratio)
    if lx - hist.sorted[0] < jump:
        return False  # the level is at least the window's least value: O(1), most steps
    return lx - recent_level(hist, config.spike_level_steps) >= jump
