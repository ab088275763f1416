"""The quiet lane: the common step under `observe` on the CPU, measured and read without packets.

Under `observe` on the CPU nothing reads a step before its update and the host read comes
right after it, so the step's values need no named slots, no pending-step bookkeeping and no
assembly: `QuietLane.begin` (optimizer step pre-hook) keeps the loss, the gradient norms and
the batch's vectors as the probes made them; `QuietLane.read` (post-hook) adds the post-update
norms, reads everything on the host (`item()` of each 0-dim value, `tolist()` of each vector:
what a CPU packet's read does, value for value) and decodes it into the same `StepStats` the
packet path gives (the same decoders, in the same order; an overflowing norm is resolved with
its extra read, as there). The detectors, the quiet gate and the record then take the step as
they take any other.

What the lane leaves to the packet path (`StepWatch`), decided per step by the guard
(`StepPath._lane_takes`): acting policies, clipping, a replay still armed, a GradScaler,
activation watching, `read_every` > 1, a parameter off the CPU (a GPU step's packet is copied
without a stall and read a step late), a step that samples the update norm, the first step
and the first after a `load_state_dict` (loaded-state flags), and the cross-rank agreement.
`tests/test_quiet_lane.py` checks that the lane and the packet path give identical statistics,
alarms, report.json and run.db.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanguard.watch.batch import BatchProbe, Taken
from nanguard.watch.norms import Norms
from nanguard.watch.stats import StepProbe, StepStats
from nanguard.watch.step import StepWatch

__all__ = ["LaneStep", "QuietLane"]


class LaneStep:
    """One step between the lane's two hooks: device values kept as the probes made them.

    `stats`, `device_skip` and `found_inf` mirror `watch.step.Pending`'s (always None / False
    here) for code that inspects the step in progress."""

    __slots__ = ("step", "lr", "loss", "grads", "idx", "batch", "rng")
    stats: StepStats | None
    device_skip: bool
    found_inf: bool

    def __init__(self, step: int, lr: float | None, loss: torch.Tensor | None,
                 grads: Norms | None, idx: list[int], batch: Taken,
                 rng: dict[str, Any] | None) -> None:
        self.step = step
        self.lr = lr
        self.loss = loss
        self.grads = grads
        self.idx = idx
        self.batch = batch
        self.rng = rng
        """RNG states at the start of the step (kept by reference; serialized only on alarm)."""


LaneStep.stats = None  # class-level: never set on a lane step
LaneStep.device_skip = False
LaneStep.found_inf = False


class QuietLane:
    """The quiet lane's two halves (see the module docstring).

    Args:
        steps: the guard's watch stage (its probes; its `host_reads` counts the lane's reads).
        every: `WatchConfig.update_ratio_every` (a step that samples the update norm is the
            packet path's).
    """

    def __init__(self, steps: StepWatch, every: int) -> None:
        self.steps = steps
        self.probe: StepProbe = steps.probe
        self.batch_probe: BatchProbe = steps.batch_probe
        self.every = every

    def begin(self, step: int, lr: float | None, loss: torch.Tensor | None,
              step_rng: dict[str, Any] | None) -> LaneStep:
        """Runs in the step pre-hook: the gradient norms (device values) and the batch taken
        for this step, kept with the loss until the post-hook reads them."""
        grads, idx = self.probe.pre_step(snapshot_update=False)
        return LaneStep(step, lr, loss, grads, idx, self.batch_probe.take(), step_rng)

    def read(self, cur: LaneStep) -> StepStats:
        """Runs in the step post-hook: the post-update norms, then ONE host read of the step
        (`StepWatch.read`) and its statistics, as `StepWatch.read_steps` decodes a step read
        right after its update (`live`: the gradients and parameters are still those
        measured)."""
        probe = self.probe
        post, layout = probe.post_norms()
        parts: list[torch.Tensor] = [] if cur.loss is None else [cur.loss]
        grads = cur.grads
        if grads is not None:
            parts += [grads] if isinstance(grads, torch.Tensor) else grads
        parts += [post] if isinstance(post, torch.Tensor) else post
        taken = cur.batch
        if taken.micro is not None:
            parts += taken.vectors(True)
        values = self.steps.read(parts)
        stats = StepStats(step=cur.step, lr=cur.lr)
        # The decoders' order is `StepWatch.decode_pre`'s, then `read_steps`' post part.
        a = 0
        if cur.loss is not None:
            stats.loss, a = values[0], 1
        b = a + len(cur.idx)
        probe.decode_pre(values[a:b], cur.idx, stats)
        c = b + len(layout.tensors)
        if taken.micro is not None:
            BatchProbe.decode_taken({"batch": values[c:]}, taken, stats)
        bp = self.batch_probe
        if bp.dropped is not None:
            stats.dropped_samples, bp.dropped = bp.dropped, None
        if stats.nonfinite_grads and any(
                math.isinf(stats.grad_norms[i]) for i in stats.nonfinite_grads):
            probe.resolve_overflow(stats)  # rare: an extra read only here
        stats.param_norms, stats.state_norms, stats.buffer_norms = layout.decode(values[b:c])
        probe.resolve_post_overflow(stats)  # an extra read only on an inf norm
        return stats
