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

Each hook is one function (`begin`, `read`): the probes' common cases (every parameter with a
gradient, `_foreach_norm` where no plan is kept, the post-update layout unchanged, a batch
measured on the host) are written inline there, so that a quiet step makes no Python call per
stage; anything else goes through the probes' own methods, which compute the same values.
"""

from __future__ import annotations

import math
import operator
from itertools import repeat
from typing import Any

import torch

from nanguard.watch.batch import BatchProbe, decode_host
from nanguard.watch.norms import F32_SET, STRIDED
from nanguard.watch.probe import StepProbe
from nanguard.watch.stats import HASHES_SLOT, StepStats
from nanguard.watch.step import StepWatch
from nanguard.watch.taken import Micro, Taken

__all__ = ["LaneStep", "QuietLane"]

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_LAYOUT = operator.attrgetter("layout")
_ITEM = torch.Tensor.item
_is = operator.is_
_NONES = repeat(None)  # never exhausted: shared by every `map` below
_F32 = torch.float32
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_new = object.__new__


class LaneStep:
    """One step between the lane's two hooks: device values kept as the probes made them.

    `device_skip` and `found_inf` mirror `watch.step.Pending`'s (always False here) for code
    that inspects the step in progress. Made by `QuietLane.begin` only."""

    __slots__ = ("step", "lr", "loss", "clip", "idx", "micro", "batch", "rng", "stats",
                 "parts", "scalars")
    device_skip: bool
    found_inf: bool
    step: int
    lr: float | None
    loss: torch.Tensor | None
    clip: bool
    """The script's own clip's measured total is among `parts` (after the loss)."""
    idx: list[int]
    micro: list[Micro] | None
    """The step's micro-batches, all measured on the host (nothing of them to read)."""
    batch: Taken | None
    """The step's batch with values to read (measured on the device), else None."""
    rng: dict[str, Any] | None
    """RNG states at the start of the step (kept by reference; serialized only on alarm)."""
    stats: StepStats | None
    """The pre-update statistics once read (acting policies read them before the update:
    `QuietLane.read_pre`)."""
    parts: list[torch.Tensor]
    """The pre-update values to read, in `QuietLane._decode_pre`'s order: the loss, the
    script's clip total, the gradient norms, the batch's vectors (none for a batch measured
    on the host)."""
    scalars: bool
    """Every one of `parts` is a 0-dim value (read with `item()` each)."""


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
        self._idx: list[int] = []
        """`range(len(params))` as a list: the gradient layout of a step where every
        parameter has a gradient (kept; read only by the decoder)."""

    def begin(self, step: int, lr: float | None, loss: torch.Tensor | None,
              step_rng: dict[str, Any] | None, clip: torch.Tensor | None = None) -> LaneStep:
        """Runs in the step pre-hook: the gradient norms (device values) and the batch taken
        for this step, kept with the loss (and `clip`, the script's own clip's measured total)
        until the post-hook reads them. The same values as `StepProbe.pre_step` and
        `BatchProbe.take` give."""
        probe = self.probe
        params = probe.params
        every = list(map(_GRAD, params))  # C-level: no call per parameter
        grads: Any
        if any(map(_is, every, _NONES)):  # a parameter without a gradient: the probe's way
            grads, idx = probe.pre_step(snapshot_update=False)
        else:
            idx = self._idx
            if len(idx) != len(every):
                idx = self._idx = list(range(len(every)))
            if (probe.plan_for is params and probe.plan is None
                    and set(map(_LAYOUT, every)) <= STRIDED
                    and set(map(_DTYPE, every)) <= F32_SET):
                # `norm_values`' common case (the lane's parameters are local: no DTensor).
                grads = torch._foreach_norm(every, 2, dtype=_F32)
            else:  # a plan, or a gradient of another dtype or layout
                grads = probe.norms_of(every)
        cur = _new(LaneStep)
        cur.step, cur.lr, cur.loss, cur.idx, cur.rng = step, lr, loss, idx, step_rng
        cur.stats = cur.batch = cur.micro = None
        parts: list[torch.Tensor] = [] if loss is None else [loss]
        cur.clip = clip is not None
        if clip is not None:
            parts.append(clip)
        scalars = True
        if grads is not None:
            if type(grads) is torch.Tensor:  # a plan's vector
                parts.append(grads)
                scalars = False
            else:
                parts += grads
        # `BatchProbe.take`, its common case (every micro-batch measured on the host) inline.
        bp = self.batch_probe
        taken = bp.parts
        bp.step_batches, bp.batches = bp.batches, []
        if taken:
            bp.parts = []
            host = True
            for m in taken:
                host = host and m.hashes is None
            if host:
                cur.micro = taken
            else:
                batch = cur.batch = bp.gather(taken)
                parts += batch.vectors()
                scalars = False
        cur.parts, cur.scalars = parts, scalars
        return cur

    def read_pre(self, cur: LaneStep) -> StepStats:
        """Runs in the step pre-hook of an acting policy (it decides before the update): one
        host read of the step's pre-update values and their statistics (kept as `cur.stats`),
        as `StepWatch.read_pre` gives them."""
        steps, parts = self.steps, cur.parts
        if cur.scalars:  # `StepWatch.read` of 0-dim values: each one's `item()`, in one map
            steps.host_reads += 1
            values = list(map(_ITEM, parts))
        else:
            values = steps.read(parts)
        stats = cur.stats = self._decode_pre(cur, values)
        return stats

    def read(self, cur: LaneStep) -> StepStats:
        """Runs in the step post-hook: the post-update norms, then ONE host read of the step
        (or of its post-update part when `read_pre` read the rest) and its statistics, as
        `StepWatch.read_steps` decodes a step read right after its update (`live`: the
        gradients and parameters are still those measured). The post-update pass is
        `StepProbe.post_norms`, its common case (the layout kept, no plan) inline."""
        probe = self.probe
        steps = self.steps
        sampler = steps.sampler
        # The optimizer state on sampled steps only: `Sampler.wants`, inline.
        last = sampler.last
        state = ((cur.step >= sampler.due or (last is not None and bool(last.alarms)))
                 and sampler.state(cur.step))
        lay = probe.bare
        if (state or lay is None or lay.params is not probe.params
                or lay.buffers is not probe.buffers):  # `PostLayout.fits` of a bare layout
            lay = probe.post_layout(state)
        tensors = lay.tensors
        # No autograd records for the parameters' norms (the hook runs in the user's grad
        # mode): what `torch.no_grad()` sets, without its context manager's calls.
        grad_mode = _grad_enabled()
        _set_grad_enabled(False)
        try:
            if lay.plain and set(map(_DTYPE, tensors)) <= F32_SET:
                post: Any = torch._foreach_norm(tensors, 2, dtype=_F32)
            else:  # a plan, or another dtype
                post, lay = probe.layout_norms(lay)
        finally:
            _set_grad_enabled(grad_mode)
        n = len(tensors)
        vector = type(post) is torch.Tensor
        post_parts = [post] if vector else list(post)
        stats = cur.stats
        # The one read (the post norms first: a known count): `StepWatch.read`, or, of 0-dim
        # values only, each one's `item()` in one C-level map, counted as it counts.
        fresh = stats is None
        parts = post_parts + cur.parts if fresh else post_parts
        if not vector and (cur.scalars or not fresh):
            steps.host_reads += 1
            values = list(map(_ITEM, parts))
        else:
            values = steps.read(parts)
        if stats is None:
            stats = self._decode_pre(cur, values[n:])
        else:  # an acting policy's step: the pre-update part was read and decoded
            stats.unseal()
        # `PostLayout.decode`, inline.
        perm = lay.perm
        pv = values if perm is None else list(map(values.__getitem__, perm))
        state_norms: dict[str, dict[int, float]] = {}
        for key, ids, a, b in lay.spans:
            norms = dict(zip(ids, pv[a:b], strict=True))
            if key == "param":
                stats.param_norms = norms
            elif key == "buffer":
                stats.buffer_norms = norms
            else:
                state_norms[key[len("state."):]] = norms
        stats.state_norms = state_norms
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
        stats = StepStats(step=cur.step, lr=cur.lr)
        a = 0
        if cur.loss is not None:
            stats.loss, a = values[0], 1
        if cur.clip:
            stats.clip_norm = values[a]
            a += 1
        # `StepProbe.decode_pre`, inline.
        idx = cur.idx
        b = a + len(idx)
        grads = values[a:b]
        norms = stats.grad_norms = dict(zip(idx, grads, strict=True))
        # Norms are >= 0: a finite float64 sum means every one is finite (the quiet step).
        if not math.isfinite(sum(grads)):
            stats.nonfinite_grads = {i for i, v in norms.items() if not math.isfinite(v)}
        micro = cur.micro
        if micro is not None:  # measured on the host: nothing of it was read
            m = micro[0]
            if len(micro) == 1 and not m.bad:  # `decode_host`'s common case, inline
                assert m.sums is not None
                # `StepStats.defer_hashes`: the sums as read, combined when first read.
                stats.__dict__[HASHES_SLOT] = (m.sums, m.n, (m.size,))
                stats.batch_tensors = m.n
            else:
                decode_host(BatchProbe.gather(micro), stats)
        elif cur.batch is not None:
            BatchProbe.decode_taken({"batch": values[b:]}, cur.batch, stats)
        bp = self.batch_probe
        if bp.dropped is not None:
            stats.dropped_samples, bp.dropped = bp.dropped, None
        if stats.nonfinite_grads and any(
                math.isinf(stats.grad_norms[i]) for i in stats.nonfinite_grads):
            self.probe.resolve_overflow(stats)  # rare: an extra read only here
        return stats
