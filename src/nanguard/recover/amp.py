"""GradScaler awareness: an fp16 overflow that the scaler skips is counted, never an alarm; a
collapsing scale is.

`GradScaler.step` unscales the gradients before `optimizer.step()` and does not call it at all
when it found an inf, so the guard's hooks only ever see unscaled gradients of steps that
happen. Skipped steps show as a lower scale at the next step the guard sees (each overflow
multiplies it by `backoff_factor`); the scale tensor rides along in the step's single host read.

`ScalerWatch` exists only when a scaler was given (`Recovery.amp`): a guard without one never
calls any of this (the pipeline leaves the check out of its step when it is built).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanguard.config import AmpConfig
from nanguard.detect.alarm import Alarm
from nanguard.recover.effects import Effect, Record
from nanguard.watch.stats import StepStats


class ScalerWatch:
    """Args:
    scaler: the `torch.amp.GradScaler` in use.
    config: collapse thresholds.
    cooldown: steps between two collapse alarms (`DetectConfig.cooldown`).
    """

    def __init__(self, scaler: Any, config: AmpConfig, cooldown: int) -> None:
        self.scaler = scaler
        self.config = config
        self.cooldown = cooldown
        self.prev: float | None = None
        self.skipped = 0
        self.halvings = 0  # consecutive decreases without growth
        self.last_collapse: int | None = None  # step of the last collapse alarm (cooldown)
        self._stall_calls = 0  # `check_stall` calls since the last step checked

    def check(self, stats: StepStats) -> tuple[list[Effect], list[Alarm]]:
        """Pre-update, each step read: count the overflow steps the scaler skipped (an
        `amp_skip` action to record); the alarms of the step on a collapse (the detectors'
        alarms join them). Marks `stats.amp_skipped`."""
        self._stall_calls = 0
        if stats.amp_scale is None:
            return [], []
        skipped, collapse = self.observe(stats.amp_scale)
        stats.amp_skipped = skipped
        effects: list[Effect] = []
        if skipped:
            effects.append(Record(
                stats.step,
                "amp_skip",
                f"GradScaler skipped {skipped} step(s) on fp16 overflow (expected, "
                f"not an alarm); scale now {stats.amp_scale:.3g}",
            ))
        if collapse is None:
            return effects, []
        return effects, self._collapse(stats.step, stats.amp_scale, collapse)

    def check_stall(self, step: int) -> list[Effect]:
        """Many `watch` calls and no optimizer step: read the scale (a rare extra read), once
        every `stall_steps` calls however often the guard asks."""
        self._stall_calls += 1
        if (self._stall_calls - 1) % max(1, self.config.stall_steps):
            return []
        scale = self.scale_tensor()
        if scale is None:
            return []
        value = float(scale.item())
        skipped, collapse = self.observe(value)
        effects: list[Effect] = []
        if skipped:
            effects.append(Record(step, "amp_skip", f"GradScaler skipped {skipped} step(s)"))
        if collapse:
            effects += self._collapse(step, value, collapse)
        return effects

    def _collapse(self, step: int, scale: float, msg: str) -> list[Alarm]:
        last = self.last_collapse
        if last is not None and step - last < self.cooldown:
            return []
        self.last_collapse = step
        return [
            Alarm(step=step, kind="amp_collapse", signal="loss_scale", value=scale, message=msg)
        ]

    def scale_tensor(self) -> torch.Tensor | None:
        """The scale, still on its device (None before the scaler's first use)."""
        scale = getattr(self.scaler, "_scale", None)
        return scale.detach().double().reshape(1) if isinstance(scale, torch.Tensor) else None

    def observe(self, scale: float) -> tuple[int, str | None]:
        """Feed the scale read at a step; return (overflow steps skipped since the last one,
        a collapse message or None)."""
        skipped = 0
        if self.prev is not None and scale < self.prev:
            backoff = float(getattr(self.scaler, "_backoff_factor", 0.5)) or 0.5
            skipped = max(1, round(math.log(self.prev / scale) / math.log(1 / backoff)))
            self.halvings += skipped
        elif self.prev is not None and scale > self.prev:
            self.halvings = 0
        self.prev = scale
        self.skipped += skipped
        collapse = None
        if scale < self.config.min_scale or self.halvings >= self.config.max_halvings:
            collapse = (
                f"GradScaler scale collapsed to {scale:.3g} after {self.halvings} "
                "overflow back-offs in a row: gradients overflow float16 at any scale"
            )
        return skipped, collapse

    def state_dict(self) -> dict[str, Any]:
        return {"prev": self.prev, "skipped": self.skipped, "halvings": self.halvings,
                "last_collapse": self.last_collapse}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prev = state["prev"]
        self.skipped = int(state["skipped"])
        self.halvings = int(state["halvings"])
        last = state.get("last_collapse")
        self.last_collapse = None if last is None else int(last)
