"""The quiet gate: a step no default detector could alarm on, applied without the detectors.

Most steps of a healthy run raise nothing, yet the seven detector objects each walked their
checks and windows on every one (about 60 Python calls a step). The gate runs when the guard
has sealed a step's values, before the detectors of a phase would: a few scalar comparisons
against the detectors' own state decide whether ANY of them could fire on this step. If one
could, the gate changes nothing and answers False (the guard runs the full detector pass, as
before). Otherwise it applies what each detector's `check` would have changed on this step
(the same window appends, medians, level peaks, growth runs, recent values and counts, in
the same float expressions) and answers True.

What it guarantees: after a step it passed, every detector's state is exactly what `check`
would have left (same `state_dict`), and `check` would have returned no alarm. The bounds are
conservative: each firing test of a detector needs one necessary condition (a spike needs its
ratio to the median at or over `spike_ratio`, or a grad norm or loss `spike_min_ratio` x the
lowest of its latest values (`detectors.trend_jump`), a cascade a run of `cascade_steps` growths, a
forecast `cascade_steps + 1` growing values, a divergence every recent loss at
`divergence_ratio` x the median, a vanishing alarm `vanishing_steps` small steps, a
non-finite one a non-finite value); the gate passes only when each such condition is false.
A cooldown that would have silenced an alarm is not counted on: the full pass decides then.
`tests/test_quiet_gate.py` runs both paths over many traces and compares alarms and states.

The gate serves only the default detectors, one of each, of exactly their classes (a subclass
may check differently): with any other set it is off and every step takes the full pass.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from typing import Any

from nanguard.detect.detectors import (
    EARLY_OVER_LARGEST,
    LEVEL_MIN_STEPS,
    CascadeDetector,
    Detector,
    DivergenceDetector,
    ForecastDetector,
    NonFiniteDetector,
    SpikeDetector,
    VanishingDetector,
    Window,
    trend_jump,
)
from nanguard.watch.stats import StepStats

_log10 = math.log10
_isfinite = math.isfinite


class QuietGate:
    """Decides, per step and phase, whether the detectors' pass can be replaced by its state
    updates alone (see the module docstring).

    Attributes:
        enabled: False turns the gate off (every step takes the full detector pass); it is
            also False when the detectors are not the default set.
        passed: steps (phases) the gate applied, for tests and benchmarks.
    """

    def __init__(self, detectors: list[Detector]) -> None:
        found: dict[Any, Detector] = {}
        for d in detectors:
            key: Any = (type(d), d.phase) if type(d) is NonFiniteDetector else type(d)
            if key in found:
                found = {}
                break
            found[key] = d
        wanted = [(NonFiniteDetector, "pre"), SpikeDetector, (NonFiniteDetector, "post"),
                  CascadeDetector, ForecastDetector, DivergenceDetector, VanishingDetector]
        self.enabled: bool = len(found) == len(detectors) == 7 and all(k in found for k in wanted)
        self.passed: int = 0
        # Detectors are held, their state read through them at each step: `load_state_dict`
        # replaces their windows and deques.
        self._nf_pre: Any = found.get((NonFiniteDetector, "pre"))
        self._nf_post: Any = found.get((NonFiniteDetector, "post"))
        self._spike: Any = found.get(SpikeDetector)
        self._cascade: Any = found.get(CascadeDetector)
        self._forecast: Any = found.get(ForecastDetector)
        self._divergence: Any = found.get(DivergenceDetector)
        self._vanishing: Any = found.get(VanishingDetector)

    def passes(self, stats: StepStats, phase: str) -> bool:
        """Apply the quiet step of the detectors of `phase` (`pre`, `post` or `both`) to their
        state and return True, or change nothing and return False (the full pass must run).

        Runs where the guard would run those detectors, after `stats.seal()`. Any error in the
        arithmetic (an overflow in `10 ** x`) also answers False: the full pass meets it.
        """
        if not self.enabled:
            return False
        signals = stats._signals
        if signals is None or signals or stats.overflowed or stats.unread_nonfinite:
            return False  # not sealed, or non-finite: the non-finite detectors' business
        pre = phase != "post"
        post = phase != "pre"
        if (pre and self._nf_pre._active) or (post and self._nf_post._active):
            return False  # an episode to end
        try:
            plan = self._decide(stats, pre, post)
        except (ArithmeticError, LookupError, ValueError):
            return False
        if plan is None:
            return False
        self._apply(stats, plan)
        self.passed += 1
        return True

    def _decide(self, stats: StepStats, pre: bool, post: bool) -> list[Any] | None:
        """What the quiet step changes, computed without changing anything; None when some
        detector could fire. The plan: [spike, cascade, forecast, divergence, vanishing] parts,
        each None when that detector is not run or changes nothing."""
        g, p, momentum = stats.global_norms()
        plan: list[Any] = [None, None, None, None, None]
        if pre:
            sp = self._spike
            grad = None
            if _isfinite(g) and g > 0 and not stats.nonfinite_grads:
                cfg = sp.config
                lx = _log10(g)
                s = sp.history["grad_norm"].sorted
                n = len(s)
                # `Window.median`, inline (the same expression; one call less per median)
                med = (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2) if n else math.nan
                if n >= cfg.warmup_steps:
                    if (10 ** (lx - med) >= cfg.spike_ratio
                            or trend_jump(lx, sp.history["grad_norm"], cfg)):
                        return None
                elif (n and 10 ** (lx - med) >= cfg.early_spike_ratio
                      and 10 ** (lx - s[-1]) >= EARLY_OVER_LARGEST):
                    return None
                grad = (lx, 10 ** med if n else None, n)
            loss = stats.loss
            lost = None
            if loss is not None and _isfinite(loss) and loss > 0:
                hl = sp.history["loss"]
                llx = _log10(loss)
                if not sp.nonstationary and trend_jump(llx, hl, sp.config):
                    return None  # the loss's spike test: the full pass decides
                s = hl.sorted
                n = len(s)
                med = (s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2) if n else None
                lost = (llx, None if med is None else 10 ** med, n)
            plan[0] = (grad, lost)
        if not post:
            return plan
        acts = stats.activations  # `act_max`, inline (no call on a step without activations)
        values = {"grad_norm": float(g), "act_max": max(acts.values()) if acts else None,
                  "momentum_norm": momentum}
        ca, fc = self._cascade, self._forecast
        growth = ca.config.cascade_growth
        steps = ca.config.cascade_steps
        runs: list[tuple[str, float, int | None, float | None]] = []
        for signal, x in values.items():
            if x is None:
                continue
            x = float(x)
            if not _isfinite(x) or x <= 0:
                runs.append((signal, x, None, None))  # the run ends, nothing else
                continue
            prev = ca.prev.get(signal)
            grew = prev is not None and x >= prev * growth
            run = ca.run[signal] + 1 if grew else 0
            if run >= steps:
                return None  # a cascade's necessary condition: the full pass decides
            runs.append((signal, x, run, prev))
        plan[1] = runs
        fsteps = fc._log_growth
        recents: list[tuple[str, float, float | None]] = []
        for signal, x in values.items():
            if x is None:
                continue
            x = float(x)
            if not _isfinite(x) or x <= 0:
                recents.append((signal, x, None))
                continue
            recent = fc.recent[signal]
            lx = _log10(x)
            m = recent.maxlen
            if m is not None and len(recent) + 1 >= m >= 2 and lx - recent[-1] >= fsteps:
                # The newest grew: growing unless an earlier step of the window (as it will be
                # after this value) did not (the detector's `all`, as a loop).
                new = [*recent, lx][-m:]
                for k in range(1, m):
                    if new[k] - new[k - 1] < fsteps:
                        break
                else:
                    return None  # growing: the full pass decides
            elif m is None or m < 2:
                return None  # a window of one value always reads as growing
            recents.append((signal, x, lx))
        plan[2] = recents
        dv = self._divergence
        loss = stats.loss
        if loss is not None and _isfinite(loss):
            cfg = dv.config
            recent = dv.recent
            new = [*recent, loss][-recent.maxlen:] if recent.maxlen else []
            hist = dv.history["loss"].sorted
            need = max(cfg.warmup_steps, 2 * cfg.divergence_steps)
            note = None
            quiet = dv.nonstationary  # its loss-trend tests are off: nothing can fire
            if len(hist) < need:
                first = dv.first
                if (not quiet and first is not None and len(new) >= 2 and first > 0
                        and min(new[-2:]) >= cfg.early_loss_ratio * first):
                    return None
            elif len(new) == recent.maxlen:
                k = len(hist)
                med = hist[k // 2] if k % 2 else (hist[k // 2 - 1] + hist[k // 2]) / 2
                if not quiet and med > 0 and min(new) >= cfg.divergence_ratio * med:
                    return None
                note = med
            plan[3] = (loss, note, len(hist))
        va = self._vanishing
        if not stats.grad_norms or not _isfinite(g) or not _isfinite(p) or p <= 0:
            count = 0
        else:
            count = va.count + 1 if g <= va.config.vanishing_norm * p else 0
        if count >= va.config.vanishing_steps:
            return None
        plan[4] = count
        return plan

    def _apply(self, stats: StepStats, plan: list[Any]) -> None:
        """Change the detectors' state as their `check` would have on this quiet step."""
        adds: list[tuple[Window, float]] = []
        spike, runs, recents, div, count = plan
        if spike is not None:
            sp = self._spike
            for signal, part in zip(("grad_norm", "loss"), spike, strict=True):
                if part is None:
                    continue
                lx, v, n = part
                if n >= LEVEL_MIN_STEPS:  # `_note_level` on the history before this step
                    sp.peak[signal] = max(sp.peak.get(signal, v), v)
                adds.append((sp.history[signal], lx))
            sp.last_lr = stats.lr
        levels = []
        if runs is not None:
            ca = self._cascade
            for signal, x, run, prev in runs:
                if run is None:
                    ca.run[signal] = 0
                    continue
                ca.run[signal] = run
                if run == 1 and prev is not None:
                    ca.start[signal] = prev
                ca.prev[signal] = x
                hist = ca.history[signal]
                if run == 0:
                    adds.append((hist, x))
                levels.append((signal, hist))
        if recents is not None:
            fc = self._forecast
            for signal, x, lx in recents:
                if lx is None:
                    fc.recent[signal].clear()
                    fc.at[signal].clear()
                    continue
                fc.recent[signal].append(lx)
                fc.at[signal].append(stats.step)
                adds.append((fc.history[signal], x))
        if div is not None:
            loss, med, n = div
            dv = self._divergence
            dv.recent.append(loss)
            if dv.first is None:
                dv.first = loss
            if med is not None and n >= LEVEL_MIN_STEPS:
                dv.peak["loss"] = max(dv.peak.get("loss", med), med)
            adds.append((dv.history["loss"], loss))
        if count is not None:
            self._vanishing.count = count
        for w, x in adds:  # `Window.append`, inline (one call for the step, not eight)
            if w.maxlen == 0:
                continue
            s = w.sorted
            if w.maxlen is not None and len(w) == w.maxlen:
                old = w[0]
                i = bisect_left(s, old)
                while i < len(s) and s[i] is not old:
                    i += 1
                if i == len(s):  # a NaN loaded from a foreign state breaks the order: scan
                    i = next(k for k, v in enumerate(s) if v is old)
                del s[i]
            deque.append(w, x)
            insort(s, x)
        ca = self._cascade
        for signal, hist in levels:  # after the appends: the cascade notes its median then
            s = hist.sorted
            k = len(s)
            if k >= LEVEL_MIN_STEPS:
                med = s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2
                ca.peak[signal] = max(ca.peak.get(signal, med), med)
