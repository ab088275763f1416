"""The quiet lane: the common CPU step, measured and read without packets.

On the CPU the host read of a step needs no named slots, no pending-step bookkeeping and no
assembly: `QuietLane.begin` (optimizer step pre-hook) keeps the loss, the gradient norms and
the batch's vectors as the probes made them (none for a small CPU batch, measured on the host
when watched: `watch.batch`); `QuietLane.read` (post-hook) adds the post-update
norms, reads everything with ONE host read (`StepWatch.read`: `item()` of each 0-dim value,
`tolist()` of each vector, what a CPU packet's read does, value for value) and decodes it into
the same `StepStats` the packet path gives (the same decoders, in the same order; an
overflowing norm is resolved with its extra read, as there). An acting policy decides before
the update: `QuietLane.read_pre` reads the pre-update part there, and `read` the post-update
part after it (two reads, as the packet path makes). The detectors, the quiet gate, the policy
and the record then take the step as they take any other: the lane decides nothing.

What the lane leaves to the packet path (`StepWatch`), decided once (`step.build`, when the
parts are made) and per step (`StepPipeline.pre_hook`): clipping, a replay still armed, a
GradScaler, activation watching, `read_every` > 1, the cross-rank agreement, a `skip` a fused
optimizer decides on the device, a parameter off the CPU (a GPU step's packet is copied without
a stall and read a step late), a step that samples the update norm, the first step and the
first after a `load_state_dict` (loaded-state flags); `WatchConfig.quiet_lane=False` leaves it
every step. The optimizer state is measured on the steps `watch.sampling` picks, here as
there. `tests/test_quiet_lane.py` checks that the lane and the
packet path leave identical statistics, alarms, actions, report.json and run.db.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from nanguard.watch.batch import BatchProbe, Taken, decode_host
from nanguard.watch.norms import Norms
from nanguard.watch.stats import StepProbe, StepStats
from nanguard.watch.step import StepWatch

__all__ = ["LaneStep", "QuietLane"]


class LaneStep:
    """One step between the lane's two hooks: device values kept as the probes made them.

    `device_skip` and `found_inf` mirror `watch.step.Pending`'s (always False here) for code
    that inspects the step in progress."""

    __slots__ = ("step", "lr", "loss", "grads", "idx", "batch", "rng", "stats", "parts")
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
        self.stats: StepStats | None = None
        """The pre-update statistics once read (acting policies read them before the
        update: `QuietLane.read_pre`)."""
        parts: list[torch.Tensor] = [] if loss is None else [loss]
        if grads is not None:
            parts += [grads] if isinstance(grads, torch.Tensor) else grads
        if batch.micro is not None and not batch.host:
            parts += batch.vectors()
        self.parts = parts
        """The pre-update values to read, in `QuietLane._decode_pre`'s order: the loss, the
        gradient norms, the batch's vectors (none for a batch measured on the host)."""


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

    def read_pre(self, cur: LaneStep) -> StepStats:
        """Runs in the step pre-hook of an acting policy (it decides before the update): one
        host read of the step's pre-update values and their statistics (kept as `cur.stats`),
        as `StepWatch.read_pre` gives them."""
        stats = cur.stats = self._decode_pre(cur, self.steps.read(cur.parts))
        return stats

    def read(self, cur: LaneStep) -> StepStats:
        """Runs in the step post-hook: the post-update norms, then ONE host read (`StepWatch
        .read`) of the step, or of its post-update part when `read_pre` read the rest, and its
        statistics, as `StepWatch.read_steps` decodes a step read right after its update
        (`live`: the gradients and parameters are still those measured)."""
        probe = self.probe
        steps = self.steps
        sampler = steps.sampler
        # The optimizer state on sampled steps only: `Sampler.wants`, inline (no call on the
        # quiet step).
        last = sampler.last
        state = ((cur.step >= sampler.due or (last is not None and bool(last.alarms)))
                 and sampler.state(cur.step))
        post, layout = probe.post_norms(state=state)
        post_parts = [post] if isinstance(post, torch.Tensor) else list(post)
        n = len(layout.tensors)
        stats = cur.stats
        if stats is not None:  # an acting policy's step: the pre-update part is read
            values = steps.read(post_parts)
            probe.decode_post({"post": values}, layout, stats)
        else:
            values = steps.read(post_parts + cur.parts)  # the post norms first: known count
            stats = self._decode_pre(cur, values[n:])
            stats.param_norms, stats.state_norms, stats.buffer_norms = layout.decode(
                values[:n])
        # Norms are >= 0: a finite sum of the post-update ones means none is infinite (the
        # every-step case, `resolve_post_overflow`'s own first test, without its call).
        if not math.isfinite(sum(values[:n])):
            # The state gone bad with them, measured now, at the first such step (the one
            # a finding names; later ones are an alarm episode's, sampled as such).
            if not state and not sampler.counts["nonfinite"] and probe.holds_state():
                steps.state_now(stats)
                sampler.counts["nonfinite"] += 1
                state = True
            probe.resolve_post_overflow(stats)  # an extra read only on an inf norm
        sampler.last, sampler.last_state = stats, state  # `Sampler.took`, without its call
        return stats

    def _decode_pre(self, cur: LaneStep, values: list[float]) -> StepStats:
        """`StepWatch.decode_pre` for the lane's step (no activations, loaded-state flags,
        scale or device skip in the lane), in its order."""
        probe = self.probe
        stats = StepStats(step=cur.step, lr=cur.lr)
        a = 0
        if cur.loss is not None:
            stats.loss, a = values[0], 1
        b = a + len(cur.idx)
        probe.decode_pre(values[a:b], cur.idx, stats)
        taken = cur.batch
        if taken.host:  # nothing of it was read
            decode_host(taken, stats)
        elif taken.micro is not None:
            BatchProbe.decode_taken({"batch": values[b:]}, taken, stats)
        bp = self.batch_probe
        if bp.dropped is not None:
            stats.dropped_samples, bp.dropped = bp.dropped, None
        if stats.nonfinite_grads and any(
                math.isinf(stats.grad_norms[i]) for i in stats.nonfinite_grads):
            probe.resolve_overflow(stats)  # rare: an extra read only here
        return stats
