"""A NaN or an Inf where the step's values should be finite: the detector of the failure itself."""

from __future__ import annotations

import math
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Detector, Norms
from nanguard.watch.stats import StepStats

FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_NORM_LIMIT = math.sqrt(FLOAT32_MAX)
"""A float32 sum of squares overflows once the norm passes sqrt(float32 max)."""


class NonFiniteDetector(Detector):
    """A NaN or Inf anywhere. Fires at the first step of each non-finite episode per signal.

    Its quiet update: a step with nothing non-finite and no episode open changes nothing here
    (`still`); one that ends an episode takes `check`.

    Args:
        signals: "pre" watches loss, gradients and activations; "post" watches parameters,
            optimizer state and buffers after the update.
    """

    def __init__(self, config: DetectConfig, signals: str) -> None:
        super().__init__(config)
        self.phase = signals
        self._active: set[str] = set()
        self._unread_warned = False
        self.still = True

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        return None if self._active else []

    def check(self, stats: StepStats) -> list[Alarm]:
        signals = stats.seal()  # as sealed by the guard (no copy, no scan), else scanned now
        if not signals and not self._active and not stats.overflowed and (
                not stats.unread_nonfinite or self._unread_warned):
            return []  # the quiet step: nothing non-finite now, no episode to end
        wanted = (("data", "loss", "grad", "activation") if self.phase == "pre"
                  else ("param", "optimizer", "buffer"))
        now = {s for s in signals if s.split(".")[0] in wanted}
        if not stats.state_norms:  # the state not measured (sampled): its episodes go on
            now |= {s for s in self._active if s.startswith("optimizer.")}
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
        self.still = not now
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
        self.still = not self._active
