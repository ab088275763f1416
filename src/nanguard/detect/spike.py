"""Spikes: a grad norm or a loss far above its recent history, at the step it happens."""

from __future__ import annotations

import math
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.bad_batch import BAD_BATCH, LossOutlier, judge, steady
from nanguard.detect.base import Append, Norms
from nanguard.detect.series import LEVEL_MIN_STEPS, SeriesDetector, robust_z
from nanguard.detect.short_batch import batch_rows, noise_scale
from nanguard.detect.trend import recent_level, trend_jump, trend_z
from nanguard.watch.stats import StepStats

EARLY_OVER_LARGEST = 3.0
"""Before `warmup_steps` of history, a spike must also be this many times the largest healthy
grad norm so far: a healthy run whose gradients climb steadily in its first steps (a GAN's
discriminator learning, an LR warm-up) never jumps 3x over all its earlier steps at once."""

_log10 = math.log10
_isfinite = math.isfinite


class SpikeDetector(SeriesDetector):
    """A grad norm or a loss far above its recent history.

    Grad norm: robust z of log10(norm) over the window AND `spike_ratio` x its median (or
    `spike_hard_ratio` x whatever the z). Both signals: `spike_strong_z` trend-robust sigma
    above the recent level and at least `spike_min_ratio` x it (the loss:
    `loss_spike_min_ratio`; `trend.trend_z`): a bad batch's 1.6-3x is far below 10x yet tens
    of sigma out. The loss test is off on a non-stationary
    objective (`nonstationary`, set by the guard: on-policy RL, a GAN), where a new rollout
    or the other network moves the loss without anything going wrong; the gradient test stays.

    A spike whose batch's own loss is an outlier after a quiet step, at an unchanged LR, is
    named a bad batch (`detect.bad_batch`): its alarms carry `cause="bad_batch"`.

    A batch smaller than the largest one seen (an epoch's short last batch) has its grad norm
    judged as a full batch's of the same noise (`detect.short_batch`); the quiet path needs
    no scaling (scaling only lowers a norm), it only notes the usual size once.
    """

    phase = "pre"
    signals = ("grad_norm", "loss")

    def __init__(self, config: DetectConfig) -> None:
        super().__init__(config)
        # A spike is a discrete event, not a state: each new one is news.
        self.cooldown = config.spike_cooldown
        self.nonstationary = False
        self.last_lr: float | None = None  # the LR of the step seen before
        self.prev_lr: float | None = None  # ...and of the step before that
        self.last_spike: int | None = None  # the step of the last spike (either signal)
        self.usual_rows = 0  # the largest batch (samples) seen (the first quiet step's, `check`'s)
        # (step, LR note) of this step's grad-norm spike whose loss stayed at its level, after
        # a quiet step at a steady LR: a bad batch if its replay shows rows far out
        # (`bad_batch.by_rows`, asked by the spike's explanation); None otherwise
        self.row_suspect: tuple[int, str] | None = None
        self._jump = math.log10(config.spike_min_ratio)  # `trend_jump`'s least jump
        self._loss_jump = math.log10(config.loss_spike_min_ratio)  # ...the loss's

    def check(self, stats: StepStats) -> list[Alarm]:
        grads = self.history["grad_norm"]
        before = grads[-1] if grads else None  # the step before's grad norm, if it was healthy
        rows = batch_rows(stats)
        scale = noise_scale(rows, self.usual_rows)
        # (as the quiet path notes it: -1 when no batch is watched)
        self.usual_rows = max(self.usual_rows, rows) or -1
        alarms, spiked = self._check_grad(stats, scale, rows)
        found, outlier = self._check_loss(stats)
        if spiked or outlier is not None:
            alarms += found
            jump = None  # how far the step before's grad norm stood over its level
            if before is not None:
                jump = 10 ** (before - recent_level(grads, self.config.spike_level_steps))
            cause = judge(stats.step, outlier, lr=stats.lr, last_lr=self.last_lr,
                          prev_lr=self.prev_lr,
                          last_spike=self.last_spike, before_jump=jump)
            if cause is not None:
                for a in alarms:
                    a.cause = BAD_BATCH
                    a.message += f"; {cause}"
            elif spiked and outlier is None:
                note = steady(stats.step, lr=stats.lr, last_lr=self.last_lr,
                              prev_lr=self.prev_lr, last_spike=self.last_spike,
                              before_jump=jump)
                self.row_suspect = None if note is None else (stats.step, note)
            self.last_spike = stats.step
        self.prev_lr, self.last_lr = self.last_lr, stats.lr
        return alarms

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (`detect.base`): no spike is possible when the grad norm is under
        `spike_ratio` x its median and not `trend_jump` (before `warmup_steps`: under
        `early_spike_ratio` x its median or `EARLY_OVER_LARGEST` x its largest), and the loss
        is not `trend_jump` (or the loss test is off). Then: the levels noted, both values
        appended, the LR kept, as `check` would."""
        cfg = self.config
        grads, losses = self.history["grad_norm"], self.history["loss"]
        # Decide first (nothing changed until both signals are known quiet); `trend_jump`'s
        # O(1) first test is made here: most steps need no call.
        g = norms[0]
        grad = None
        if _isfinite(g) and g > 0 and not stats.nonfinite_grads:
            lx = _log10(g)
            s = grads.sorted
            n = len(s)
            med = grads.mid
            if n >= cfg.warmup_steps:
                if n and (10 ** (lx - med) >= cfg.spike_ratio
                          or (lx - s[0] >= self._jump and trend_jump(lx, grads, cfg))):
                    return None
            elif (n and 10 ** (lx - med) >= cfg.early_spike_ratio
                  and 10 ** (lx - s[-1]) >= EARLY_OVER_LARGEST):
                return None
            grad = (lx, 10 ** med if n >= LEVEL_MIN_STEPS else None)
        loss = stats.loss
        lost = None
        if loss is not None and _isfinite(loss) and loss > 0:
            llx = _log10(loss)
            s = losses.sorted
            if (not self.nonstationary and s and llx - s[0] >= self._loss_jump
                    and trend_jump(llx, losses, cfg, cfg.loss_spike_min_ratio)):
                return None
            lost = (llx, 10 ** losses.mid if len(s) >= LEVEL_MIN_STEPS else None)
        # Quiet: what `check` changes (`_note_level` inline, before the append as there).
        # The usual batch size, from the first quiet step (a quiet run's `check` may never
        # run before an epoch's short last batch), then from the steps `check` sees: one
        # attribute test a quiet step. (A batch size that grows later, seen only by quiet
        # steps, leaves it low: a larger batch is never scaled, a shorter one less.)
        if not self.usual_rows:  # (-1: no batch watched, not asked again)
            self.usual_rows = batch_rows(stats) or -1
        peak = self.peak
        appends: list[Append] = []
        if grad is not None:
            lx, v = grad
            if v is not None:
                peak["grad_norm"] = max(peak.get("grad_norm", v), v)
            appends.append((grads, lx, None, ""))
        if lost is not None:
            llx, v = lost
            if v is not None:
                peak["loss"] = max(peak.get("loss", v), v)
            appends.append((losses, llx, None, ""))
        self.prev_lr, self.last_lr = self.last_lr, stats.lr
        return appends

    def _check_grad(self, stats: StepStats, scale: float = 1.0, rows: int = 0
                    ) -> tuple[list[Alarm], bool]:
        """The grad norm's tests: (alarms, whether it spiked: an alarm a cooldown silenced
        still keeps the value out of the window). `scale`: `short_batch.noise_scale` of a
        batch of `rows` samples, below 1 for a batch shorter than the usual."""
        x = stats.judged_grad_norm
        hist = self.history["grad_norm"]
        if not math.isfinite(x) or x <= 0 or stats.nonfinite_grads:
            return [], False
        # Where the script clips, the norm judged is its clip's total (`judged_grad_norm`).
        what = "grad norm" if stats.clip_norm is None else "grad norm before your clip"
        short = ""
        if scale < 1.0:
            short = (f" (measured {x:.3g} on a batch of {rows} samples, not "
                     f"{self.usual_rows}: scaled by sqrt({rows}/{self.usual_rows}) for its "
                     "noisier gradient)")
            x *= scale
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
            # (a short batch's norm is scaled, but `spike_hard_ratio` x the median measured
            # as it is stays a spike: noise that large would take a batch of 1/900 the size)
            raw = ratio / scale
            if (
                raw >= cfg.spike_ratio  # the cheap test first: no side effects
                and self._reaches_level("grad_norm", x)
                and (((z := robust_z(lx, hist, floor=0.05)[0]) >= cfg.spike_z
                      and ratio >= cfg.spike_ratio)
                     or raw >= cfg.spike_hard_ratio)
            ):
                is_spike = True
                alarms = self._fire(
                    stats,
                    "spike",
                    "grad_norm",
                    x,
                    f"{what} {x:.3g} is {ratio:.3g}x its recent median {10**med:.3g} "
                    f"(robust z {z:.1f}){short}",
                )
            elif trend_jump(lx, hist, cfg) and self._reaches_level("grad_norm", x):
                tz, level = trend_z(lx, hist, cfg.spike_level_steps, floor=1e-3)
                if tz >= cfg.spike_strong_z and lx - level >= math.log10(cfg.spike_min_ratio):
                    is_spike = True
                    alarms = self._fire(
                        stats, "spike", "grad_norm", x,
                        f"{what} {x:.3g} is {10 ** (lx - level):.3g}x its recent level "
                        f"{10 ** level:.3g} ({tz:.0f} sigma of its step-to-step changes){short}")
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
                f"{what} {x:.3g} is {ratio:.3g}x the median of the {len(hist)} healthy "
                f"step(s) so far ({10 ** med:.3g}; largest "
                f"{10 ** hist.largest():.3g}){short}",
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
        if (not self.nonstationary and trend_jump(lx, hist, cfg, cfg.loss_spike_min_ratio)
                and self._reaches_level("loss", x)):
            tz, level = trend_z(lx, hist, cfg.spike_level_steps, floor=1e-3)
            if tz >= cfg.spike_strong_z and lx - level >= self._loss_jump:
                outlier = LossOutlier(x, 10 ** level, tz)
                return self._fire(
                    stats, "spike", "loss", x,
                    f"loss {x:.4g} is {x / outlier.level:.3g}x its recent level "
                    f"{outlier.level:.4g} ({tz:.0f} sigma of its step-to-step changes)"
                ), outlier
        hist.append(lx)
        return [], None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "last_lr": self.last_lr, "prev_lr": self.prev_lr,
                "last_spike": self.last_spike, "usual_rows": self.usual_rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.last_lr = state.get("last_lr")  # absent in states saved before the loss test
        self.prev_lr = state.get("prev_lr")  # (absent before the LR of two steps back)
        self.last_spike = state.get("last_spike")
        self.usual_rows = int(state.get("usual_rows", 0))  # (absent before short batches)
