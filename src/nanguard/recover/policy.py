"""The guard's recovery side: rollback, adaptive clipping and GradScaler awareness.

The Guard owns one `Recovery` and calls it at fixed points of a step; each feature is off (and
costs nothing) unless its policy, config or object was given.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from nanguard.detect.alarm import Alarm
from nanguard.integrations import distributed
from nanguard.recover.amp import ScalerWatch
from nanguard.recover.clip import AdaptiveClipper
from nanguard.recover.rollback import GiveUp, Rollback
from nanguard.recover.snapshot import HostSnapshot
from nanguard.watch.stats import StepStats

if TYPE_CHECKING:
    from nanguard.guard import Guard


class Recovery:
    """Args:
    guard: the guard this serves.
    scheduler: LR scheduler restored by a rollback (optional).
    scaler: `torch.amp.GradScaler` (optional).
    """

    def __init__(self, guard: Guard, *, scheduler: Any = None, scaler: Any = None) -> None:
        self.guard = guard
        cfg = guard.config
        self.rollbacker: Rollback | None = None
        if cfg.policy == "rollback":
            snapshot = HostSnapshot(
                guard.model, guard.optimizer, extras={"scheduler": scheduler, "scaler": scaler}
            )
            # The initial state is the first "last good" one (taken between steps).
            snapshot.capture(guard.step, in_step=False)
            self.rollbacker = Rollback(cfg.recover, snapshot, guard.optimizer)
        self.clipper = AdaptiveClipper(cfg.clip) if cfg.clip is not None else None
        self.amp = ScalerWatch(scaler, cfg.amp) if scaler is not None else None

    # -- GradScaler

    def scale_tensor(self) -> torch.Tensor | None:
        return self.amp.scale_tensor() if self.amp else None

    def check_amp(self, stats: StepStats) -> list[Alarm]:
        """Pre-step: count the overflow steps the scaler skipped; alarm on a collapse."""
        if self.amp is None or stats.amp_scale is None:
            return []
        skipped, collapse = self.amp.observe(stats.amp_scale)
        stats.amp_skipped = skipped
        if skipped:
            self.guard._action(
                stats.step,
                "amp_skip",
                f"GradScaler skipped {skipped} step(s) on fp16 overflow (expected, "
                f"not an alarm); scale now {stats.amp_scale:.3g}",
            )
        if collapse is None:
            return []
        return self._collapse(stats.step, stats.amp_scale, collapse)

    def check_stall(self, step: int) -> None:
        """Many `watch` calls and no optimizer step: read the scale once (a rare extra read)."""
        if self.amp is None:
            return
        scale = self.amp.scale_tensor()
        if scale is None:
            return
        self.guard._watch_calls = 0
        skipped, collapse = self.amp.observe(float(scale.item()))
        if skipped:
            self.guard._action(step, "amp_skip", f"GradScaler skipped {skipped} step(s)")
        if collapse:
            for a in self._collapse(step, float(scale.item()), collapse):
                self.guard.alarms.append(a)
                self.guard.store.write_alarm(a.to_dict())

    def _collapse(self, step: int, scale: float, msg: str) -> list[Alarm]:
        last = [a for a in self.guard.alarms if a.kind == "amp_collapse"]
        if last and step - last[-1].step < self.guard.config.detect.cooldown:
            return []
        return [
            Alarm(step=step, kind="amp_collapse", signal="loss_scale", value=scale, message=msg)
        ]

    # -- before / after the update

    def before_update(self, stats: StepStats) -> None:
        """Pre-hook, when the update goes ahead: adaptive clipping, then the LR backoff."""
        if self.clipper is not None:
            action, scale = self.clipper.decide(
                stats.grad_norm if not stats.nonfinite_grads else math.nan
            )
            if action == "skip":
                self.guard.discard_update(stats)
                self.guard._action(
                    stats.step,
                    "skip",
                    "non-finite grad norm: update discarded, clip statistics kept",
                )
                return
            if action == "clip":
                grads = [p.grad for p in self.guard.params if p.grad is not None]
                torch._foreach_mul_(grads, scale)
                self.guard._action(
                    stats.step,
                    "clip",
                    f"grad norm {stats.grad_norm:.3g} clipped by {scale:.3g} "
                    f"(adaptive threshold {stats.grad_norm * scale:.3g})",
                )
        if self.rollbacker is not None:
            self.rollbacker.backoff_on(stats.step)

    def after_update(self) -> None:
        if self.rollbacker is not None:
            self.rollbacker.backoff_off()

    def maybe_snapshot(self, stats: StepStats) -> None:
        """Post-hook, once the step is read: refresh the last good state when it is due."""
        if self.rollbacker is None:
            return
        healthy = not stats.alarms and not stats.nonfinite_signals() and not stats.skipped
        if distributed.active() and (stats.step + 1) % self.rollbacker.config.snapshot_every == 0:
            # Every rank must keep the same last good step, or a rollback would desync them.
            device = self.guard.params[0].device if self.guard.params else torch.device("cpu")
            healthy = not distributed.agree(not healthy, None, device)[0]
        self.rollbacker.maybe_capture(stats.step + 1, healthy)

    def rollback(self, stats: StepStats, why: str, post: bool) -> None:
        """The `rollback` policy's action (all ranks call it in the same step)."""
        assert self.rollbacker is not None
        try:
            restored = self.rollbacker.rollback(stats.step)
        except GiveUp as exc:
            self.guard._action(stats.step, "give_up", f"{exc} ({why})")
            self.guard.stop(stats, f"{exc} ({why})")
            return
        if not post:
            self.guard.discard_update(stats)
        stats.skipped = True
        cfg = self.rollbacker.config
        self.guard._action(
            stats.step,
            "rollback",
            f"restored the state of step {restored}, discarding steps {restored}..{stats.step} "
            f"({why}); LR x{self.rollbacker.factor:g} for {cfg.backoff_steps} steps",
        )

    # -- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollback": self.rollbacker.state_dict() if self.rollbacker else None,
            "clip": self.clipper.state_dict() if self.clipper else None,
            "amp": self.amp.state_dict() if self.amp else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, obj in (("rollback", self.rollbacker), ("clip", self.clipper), ("amp", self.amp)):
            if obj is not None and state.get(part) is not None:
                obj.load_state_dict(state[part])
        if self.rollbacker is not None and not self.rollbacker.snapshot.in_step:
            # The snapshot taken when this guard was built is the state at the step resumed
            # from (the guard's step counter, already loaded), not at step 0.
            self.rollbacker.snapshot.step = self.guard.step
