"""How far a rollback backs the LR off: as far as the evidence calls for, and why.

A rollback returns to a good state; whether the LR must also come down depends on what went
wrong. The evidence is the recent magnitudes the guard measured (`GrowthTrail`, fed once per
step) and what the step that rolled back held:

- Consecutive multiplicative growth (a cascade, a forecast): the iteration amplifies itself at
  this LR. The LR is cut in proportion to the growth per step `g`, by `1/g`: for gradient
  descent on a curvature `h`, a mode grows `lr*h - 1` times per step, so `lr*h = 1 + g`, and
  `lr/g` brings it to `(1 + g)/g < 2`, back below the stability edge. The cut is at least
  `RecoverConfig.backoff_factor` (a measured cascade is never waved through) and at most
  `RecoverConfig.backoff_min` (the growth of a cascade's last steps, 1e3x per step and more,
  is the runaway's own, not the LR's). Growth that starts with a spike (one outlier batch, 10x
  and more in one step) is measured from the spike on: the spike is the batch's, the growth
  after it the LR's.
- A spike, an overflow, with no growth after it: one outlier batch is no evidence that the LR
  is too high. The LR is kept; the batch is left out.
- A non-finite value in the batch itself (NaN / Inf rows): the data, not the LR. Kept.
- A non-finite value with no growth before it and clean data: the cause is unknown; the
  configured cut, `backoff_factor`.
- A loss divergence (when acted on) with no growth in the norms: `backoff_factor`.
- A repeat within `RecoverConfig.window`: training keeps failing whatever the cause: the new
  cut compounds with the last one (at least `backoff_factor` more).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from nanguard.config import DetectConfig, RecoverConfig
from nanguard.watch.stats import StepStats

SIGNALS = ("grad_norm", "momentum_norm", "act_max")
"""The magnitudes whose growth is evidence against the LR (the cascade detectors' signals)."""

MIN_GROWTH_STEPS = 2
"""Steps of growth (after a spike, if one opened the run) that count as growth at all."""


@dataclass(frozen=True, kw_only=True)
class Growth:
    """A run of consecutive multiplicative growth in one signal, ending at the newest value."""

    signal: str
    steps: int
    """Steps of growth measured (from the spike on, when one opened the run)."""
    per_step: float
    """Geometric mean growth factor per step over those steps."""
    start: float
    end: float
    spike_step: int | None
    """The step of the spike that opened the run (None: the run grew from a normal level)."""


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """What one rollback does to the LR."""

    factor: float
    """This event's own factor (before compounding with an earlier rollback's)."""
    why: str
    """The evidence, for `actions[].detail`."""


class GrowthTrail:
    """The last few finite magnitudes of each signal, with their steps (fed once per step)."""

    def __init__(self, length: int = 16) -> None:
        self.values: dict[str, deque[tuple[int, float]]] = {
            s: deque(maxlen=length) for s in SIGNALS
        }
        self.after = -1  # steps up to this one were discarded by a rollback: not evidence

    def observe(self, stats: StepStats) -> None:
        """Note the step's magnitudes; a non-finite one ends the trail's usable part (kept out,
        the run of growth up to it is the evidence)."""
        if stats.step <= self.after:
            return
        for s in SIGNALS:
            v = getattr(stats, s)
            if v is None:
                continue
            trail = self.values[s]
            if trail and trail[-1][0] >= stats.step:
                trail.pop()  # the same step seen again (pre, then post): the newer wins
            if math.isfinite(v) and v > 0:
                trail.append((stats.step, float(v)))

    def clear(self, step: int) -> None:
        """After a rollback at `step`: what led to it belongs to the discarded steps."""
        self.after = step
        for trail in self.values.values():
            trail.clear()

    def growth(self, detect: DetectConfig) -> Growth | None:
        """The strongest run of growth ending at each signal's newest value (steps of at
        least `detect.cascade_growth` x each), or None when no signal has one of
        `MIN_GROWTH_STEPS` steps."""
        best: Growth | None = None
        for s, trail in self.values.items():
            g = _run(s, list(trail), detect)
            if g is not None and (best is None or math.log(g.end / g.start)
                                  > math.log(best.end / best.start)):
                best = g
        return best

    def state_dict(self) -> dict[str, Any]:
        return {"after": self.after,
                **{s: [[k, v] for k, v in t] for s, t in self.values.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.after = int(state.get("after", -1))
        for s, pairs in state.items():
            if s in self.values:
                self.values[s].clear()
                self.values[s].extend((int(k), float(v)) for k, v in pairs)


def _run(signal: str, trail: list[tuple[int, float]], detect: DetectConfig) -> Growth | None:
    """The run of growth ending at the newest value of one signal."""
    if len(trail) < 2:
        return None
    k = len(trail) - 1
    while k > 0:
        (s0, v0), (s1, v1) = trail[k - 1], trail[k]
        # Sampled signals skip steps: the growth needed is per step.
        if v1 < v0 * detect.cascade_growth ** max(s1 - s0, 1):
            break
        k -= 1
    run = trail[k:]
    if len(run) < 2:
        return None
    spike_step = None
    if len(run) >= 2 and run[1][1] >= detect.spike_ratio * run[0][1]:
        spike_step = run[1][0]
        run = run[1:]  # the spike is the batch's; the growth after it the LR's
    steps = run[-1][0] - run[0][0]
    if len(run) - 1 < MIN_GROWTH_STEPS or steps < 1:
        return None
    per_step = (run[-1][1] / run[0][1]) ** (1.0 / steps)
    return Growth(signal=signal, steps=steps, per_step=per_step, start=run[0][1],
                  end=run[-1][1], spike_step=spike_step)


def decide(stats: StepStats, trail: GrowthTrail, recover: RecoverConfig,
           detect: DetectConfig) -> Backoff:
    """The evidence-sized factor for a rollback at the step of `stats` (see the module
    docstring); compounding with earlier rollbacks is `Rollback.rollback`'s."""
    lo, hi = recover.backoff_min, recover.backoff_factor
    if hi >= 1.0:
        return Backoff(factor=1.0, why="backoff_factor 1: no backoff")
    grown = trail.growth(detect)
    kinds = {a.kind for a in stats.alarms}
    nonfinite = [s for s in stats.seal() if s != "data"]
    if grown is not None:
        factor = min(hi, max(lo, 1.0 / grown.per_step))
        after = (f" after the spike at step {grown.spike_step}" if grown.spike_step is not None
                 else "")
        bound = ("" if lo < 1.0 / grown.per_step < hi else
                 f", bounded to [{lo:g}, {hi:g}]")
        return Backoff(factor=factor, why=(
            f"{grown.steps} step(s) of {grown.per_step:.3g}x {grown.signal} growth per step "
            f"({grown.start:.3g} -> {grown.end:.3g}){after}: cut by 1/{grown.per_step:.3g}"
            f"{bound}"))
    if nonfinite and (stats.nonfinite_samples or stats.nonfinite_tensors):
        rows = stats.nonfinite_samples[:8]
        return Backoff(factor=1.0, why=(
            "the batch itself held non-finite values"
            + (f" (sample(s) {', '.join(map(str, rows))})" if rows else "")
            + ": the data, not the LR"))
    if nonfinite:
        return Backoff(factor=hi, why=(
            f"non-finite {', '.join(nonfinite)} with no growth measured before it: cause "
            "unknown, the configured backoff_factor"))
    if "divergence" in kinds:
        return Backoff(factor=hi, why="the loss diverged with no growth in the norms: "
                       "the configured backoff_factor")
    what = ", ".join(sorted(kinds)) or "an early warning"
    return Backoff(factor=1.0, why=(
        f"{what} and no run of growth in the norms: one outlier batch is no evidence that "
        "the LR is too high (the batch is left out)"))
