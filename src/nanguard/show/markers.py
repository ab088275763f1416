"""Where the report draws non-finite values and spike episodes, and which series get a log
axis."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nanguard.show.series import Buckets

BAD = "#d62728"
"""The color of everything non-finite."""


def bad_markers(b: Buckets) -> tuple[list[int], list[float], list[str],
                                     list[int | None], list[float | None]]:
    """Where to draw the non-finite values of a series. Consecutive buckets holding one are
    a run: a marker at the run's first non-finite step, at the height of the largest finite
    value of that bucket (or the nearest finite value before it), and a red segment at that
    height over the rest of the run (one marker per bucket would be hundreds of identical
    crosses for a series that stays NaN, and slow to draw). Every non-finite bucket is
    covered by its run's marker or segment.

    Returns:
        marker x, y and hover text; segment x and y (runs separated by None).
    """
    has = np.flatnonzero(b.nonfinite > 0)
    if len(has) == 0:
        return [], [], [], [], []
    level = np.where(np.isfinite(b.last), b.last, b.hi)
    finite = np.isfinite(level)
    fallback = float(np.nanmax(np.where(finite, level, np.nan))) if finite.any() else 1.0
    idx = np.where(finite, np.arange(len(level)), -1)
    idx = np.maximum.accumulate(idx)
    starts = has[np.r_[True, np.diff(has) > 1]]
    ends = has[np.r_[np.diff(has) > 1, True]]
    xs, ys, texts = [], [], []
    seg_x: list[int | None] = []
    seg_y: list[float | None] = []
    for i, e in zip(starts, ends, strict=True):
        j = idx[i - 1] if i > 0 else -1
        if math.isfinite(b.hi[i]):
            y = float(b.hi[i])
        elif j >= 0:
            y = float(level[j])
        else:
            y = fallback
        y = y if y > 0 else 1.0
        v = float(b.bad_value[i])
        x0 = int(b.bad_step[i])
        xs.append(x0)
        ys.append(y)
        n = int(b.nonfinite[i:e + 1].sum())
        last = int(b.step[e + 1]) - 1 if e + 1 < len(b) else None
        span = f"steps {int(b.step[i])}..{'' if last is None else last}"
        texts.append(f"{'nan' if math.isnan(v) else v} at step {x0}"
                     + (f" ({n} non-finite in {span})" if n > 1 else ""))
        if e > i:
            seg_x += [x0, int(b.bad_step[e]), None]
            seg_y += [y, y, None]
    return xs, ys, texts, seg_x, seg_y


def positive(series: Sequence[Buckets]) -> bool:
    """Log axis: every finite value positive and spanning more than a decade (a narrower
    span on a log axis gets stray '2' / '5' minor tick labels and reads worse than linear)."""
    lo = [b.lo[np.isfinite(b.lo)] for b in series]
    hi = [b.hi[np.isfinite(b.hi)] for b in series]
    allv = np.concatenate(lo) if lo else np.zeros(0)
    top = np.concatenate(hi) if hi else np.zeros(0)
    if not len(allv) or not bool(np.all(allv > 0)):
        return False
    return float(top.max()) > 10 * float(allv.min())


SPIKE = "#ff9896"
"""The shade of a loss spike episode."""


def episode_spans(measures: dict[str, Any] | None, last_step: int
                  ) -> tuple[list[float], list[float], list[str]]:
    """Where to shade the loss spike episodes of `report.spike_measures`: from the jump to
    the recovery step (an open episode: to `last_step`), widened to at least one step so a
    one-step spike stays visible.

    Returns:
        x0, x1 and hover text per episode.
    """
    x0: list[float] = []
    x1: list[float] = []
    texts: list[str] = []
    for e in (measures or {}).get("episodes") or []:
        start = e.get("start")
        if not isinstance(start, int):
            continue
        end = e.get("recovered_at")
        end = end if isinstance(end, int) else max(start, last_step)
        x0.append(start - 0.5)
        x1.append(max(end, start + 1) - 0.5)
        how = (f"back after {e.get('recovery_steps')} steps" if not e.get("open")
               else "not recovered when the run ended")
        before = e.get("before") or {}
        lead = "; ".join(f"{k} {_num(b.get('ratio'))}x baseline {b.get('steps_before')} "
                         "step(s) before" + _fell(b) for k, b in before.items())
        texts.append(f"spike at step {start}: loss {_num(e.get('value'))} over a level of "
                     f"{_num(e.get('baseline'))}, peak {_num(e.get('peak_value'))} at step "
                     f"{e.get('peak_step')}; {how}" + (f"; {lead}" if lead else ""))
    return x0, x1, texts


def _fell(b: dict[str, Any]) -> str:
    """` (down to 0.09x)` when the signal also fell below half its baseline in the lookback
    (a decayed Adam second moment); empty otherwise."""
    low = b.get("min_ratio")
    return f" (down to {_num(low)}x)" if isinstance(low, (int, float)) and low < 0.5 else ""


def _num(x: Any) -> str:
    return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)
