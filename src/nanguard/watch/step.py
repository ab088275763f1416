"""The watch stage of a training step: what is measured on the device, and how the host reads it.

A step travels in two packets (`watch.packet`): the pre-update one (`StepWatch.begin`, in the
optimizer's step pre-hook: loss, gradient norms, activation abs-max, loaded-state flags, batch
fingerprints and row sums, the GradScaler's scale) and the post-update one (`StepWatch.end`,
in the post-hook: parameter and buffer norms; optimizer-state norms and the update norm on
sampled steps, `watch.sampling`). Both
stay on the device until `read` turns one or more steps into `StepStats` with one host read
(`host_reads` counts them). What happens next (detectors, the policy, the record) is the
guard's business: this stage never decides anything and never writes the run store.

The one exception to "nothing but the read": an infinite norm may be a float32 sum of squares
that overflowed while every element is finite. For the step that just ended (its gradients and
parameters still live) that is told apart by an extra read, only then; for older buffered
steps (`WatchConfig.read_every` > 1) by what followed them (`StepStats.assume_overflow`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nanguard.config import WatchConfig
from nanguard.watch import unread
from nanguard.watch.activations import ActivationProbe, dtype_max
from nanguard.watch.batch import BatchProbe
from nanguard.watch.layout import PostLayout
from nanguard.watch.norms import Norms
from nanguard.watch.packet import Packet, host_values, read_packets
from nanguard.watch.probe import StepProbe
from nanguard.watch.sampling import Sampler
from nanguard.watch.stats import StepStats
from nanguard.watch.taken import Taken

__all__ = ["Pending", "StepWatch"]


@dataclass
class Pending:
    """One step's device-side statistics, waiting for the host read."""

    step: int
    lr: float | None
    pre: Packet
    """Before the update: slots `loss`, `grad`, `act`, `attn`, `loaded`, `batch`, `scale` (and
    `found_inf` when `skip` is decided on the device)."""
    grad_layout: list[int]
    act_names: list[str]
    batch: Taken
    """The step's batch as `BatchProbe.take` gave it (slot `batch`)."""
    post: Packet | None = None
    """After the update: slots `post` (parameter, state and buffer norms) and `update` (see
    `StepProbe.post_step`)."""
    post_layout: PostLayout | None = None
    stats: StepStats | None = None
    """The pre-update statistics once read (acting policies read them before the update)."""
    rng: dict[str, Any] | None = None
    """RNG states at the start of the step (kept by reference; serialized only on alarm)."""
    loaded: list[str] = field(default_factory=list)
    """Names of the tensors in the `loaded` slot (first step, or the first after a
    `load_state_dict`)."""
    device_skip: bool = False
    """`skip` decided on the device: the fused optimizer got a `found_inf` flag (slot
    `found_inf`) and skipped the update itself if it was set; the host learns it at the read."""
    found_inf: bool = False
    """The `found_inf` flag as read on the host."""
    state: bool = True
    """Whether the post-update pass measured the optimizer state (`watch.sampling`)."""


class StepWatch:
    """Builds each step's packets and reads them back as `StepStats`.

    Args:
        probe: the gradient / parameter / optimizer-state / buffer norms.
        batch_probe: the batch handed to `Guard.watch` (fingerprints, NaN rows).
        act_probe: per-module activation abs-max, or None when activations are not watched.
        config: the guard's watch settings (`update_ratio_every`).
        on_loaded: called as `on_loaded(step, names, flags)` when a step carrying loaded-state
            flags is decoded, before its statistics are returned (the guard turns them into
            a `checkpoint` finding).
    """

    def __init__(self, probe: StepProbe, batch_probe: BatchProbe,
                 act_probe: ActivationProbe | None, config: WatchConfig,
                 on_loaded: Callable[[int, list[str], list[float]], None]) -> None:
        self.probe = probe
        self.batch_probe = batch_probe
        self.act_probe = act_probe
        self.config = config
        self._on_loaded = on_loaded
        self.host_reads = 0
        """Host reads made so far (one per read step; tests hold the hot path to it)."""
        self.sampler = Sampler(config)
        """Which steps measure the optimizer state (`watch.sampling`)."""

    def saw_save(self) -> None:
        """A checkpoint save the guard saw (its `state_dict()`): the next step measures the
        optimizer state."""
        self.sampler.saw_save()

    def sampling(self) -> dict[str, Any]:
        """report.json's `sampling` (`Sampler.report`)."""
        return self.sampler.report()

    def state_now(self, stats: StepStats) -> None:
        """Measure the optimizer state as it is now into `stats` (one norm pass, one host
        read): a step that did not sample it, while its parameters are still those measured
        (`watch.sampling`)."""
        norms, layout = self.probe.post_norms(state=True)
        values = self.read(norms if isinstance(norms, torch.Tensor) else list(norms))
        _, stats.state_norms, _ = layout.decode(values)
        stats.unseal()

    def read(self, t: torch.Tensor | list[torch.Tensor]) -> list[float]:
        """The one host read: a device tensor to a Python list. On the CPU, a list of CPU
        tensors (0-dim values and vectors) read one after the other into one list: host memory
        already, nothing to synchronize and no copy into one tensor to pay
        (`packet.read_packets`, `packet.host_values`)."""
        self.host_reads += 1
        return host_values(t)

    def begin(self, step: int, lr: float | None, device: torch.device,
              loss: torch.Tensor | None, scale: torch.Tensor | None,
              loaded: list[str], flags: torch.Tensor | None,
              step_rng: dict[str, Any] | None, clip: torch.Tensor | None = None
              ) -> tuple[Pending, Norms | None]:
        """Runs in the step pre-hook (after backward and clipping, before the update): the
        step's pre-update packet (`clip`: the script's own clip's measured total, or None).
        Returns the pending step and its gradient norms (device values, for a `skip` decided
        on the device)."""
        every = self.config.update_ratio_every
        grads, layout = self.probe.pre_step(snapshot_update=every > 0 and step % every == 0)
        pre = Packet(device)
        if loss is not None:
            pre.add("loss", loss)
        if clip is not None:
            pre.add("clip", clip)
        if grads is not None:
            pre.add("grad", grads)
        act_names: list[str] = []
        if self.act_probe:
            act_names, acts = self.act_probe.collect()
            if acts is not None:
                pre.add("act", acts)
            attn = self.act_probe.attention_max()
            if attn is not None:
                pre.add("attn", attn)
        if loaded:
            assert flags is not None
            pre.add("loaded", flags)
        batch = self.batch_probe.take()
        batch.add_to(pre)
        if scale is not None:
            pre.add("scale", scale)
        pending = Pending(step=step, lr=lr, pre=pre, grad_layout=layout, act_names=act_names,
                          batch=batch, rng=step_rng, loaded=loaded)
        return pending, grads

    def end(self, cur: Pending) -> bool:
        """Runs in the step post-hook, right after the update: the post-update packet.

        Returns whether the step's packets were sent to the host without waiting: on a GPU,
        when nothing read the step before its update (`observe`), both packets are copied to
        pinned host memory with `non_blocking=True` (`Packet.start_copy`), to be read a step
        later, when the copy is long done."""
        cur.post = Packet(cur.pre.device)
        cur.state = self.sampler.wants(cur.step)
        cur.post_layout = self.probe.post_step(cur.post, state=cur.state)
        if cur.stats is not None or cur.pre.device.type != "cuda":
            return False
        cur.pre.start_copy()
        cur.post.start_copy()
        return True

    def read_pre(self, p: Pending) -> StepStats:
        """Read the pre-update packet of the step in progress now (acting policies decide
        before the update; a replay needs the parameters as they were)."""
        return self.decode_pre(p, read_packets([p.pre], self.read)[0])

    def read_steps(self, pending: list[Pending], live_last: bool = True
                   ) -> list[tuple[Pending, StepStats, bool]]:
        """Read `pending` steps with one host read: (step, its statistics, whether its
        pre-update part was read only now) in step order. `live_last`: the newest of them is
        the step that just ended (its gradients and parameters are still those it measured)."""
        packets: list[Packet] = []
        for p in pending:
            assert p.post is not None
            packets += [p.pre, p.post] if p.stats is None else [p.post]
        per_packet = iter(read_packets(packets, self.read))
        decoded: list[tuple[Pending, StepStats, bool]] = []
        for p in pending:
            # Only the newest step's gradients and parameters are still live: the extra read
            # that tells an overflowing norm from a non-finite value is only possible there.
            live = live_last and p is pending[-1]
            stats = p.stats
            fresh = stats is None
            if stats is None:
                stats = self.decode_pre(p, next(per_packet), live=live)
            assert p.post is not None
            assert p.post_layout is not None
            self.probe.decode_post(p.post.decode(next(per_packet)), p.post_layout, stats)
            state = p.state
            if live:
                if (not state and not self.sampler.counts["nonfinite"]
                        and not math.isfinite(sum(stats.param_norms.values())
                                              + sum(stats.buffer_norms.values()))
                        and self.probe.holds_state()):
                    # The state that went bad with them, measured while it is still this
                    # step's: the finding names it, as on a sampled step (the first such
                    # step only: later ones are an alarm episode's, sampled as such).
                    self.state_now(stats)
                    self.sampler.counts["nonfinite"] += 1
                    state = True
                self.probe.resolve_post_overflow(stats)  # an extra read only on an inf norm
            self.sampler.took(stats, state)
            decoded.append((p, stats, fresh))
        if len(decoded) > 1:
            newest = decoded[-1][1]
            params_finite_now = not any(
                s.startswith(("param", "optimizer")) for s in newest.seal())
            for k, (_, stats, _) in enumerate(decoded[:-1]):
                # Older buffered steps (read_every > 1): their parameters were finite after the
                # update if they are finite now, or if the next step's forward gave a finite
                # loss with them; then their infinite norms were overflows.
                next_loss = decoded[k + 1][1].loss
                if params_finite_now or (next_loss is not None and math.isfinite(next_loss)):
                    stats.assume_overflow()
        return decoded

    def decode_pre(self, p: Pending, values: list[float], live: bool = True) -> StepStats:
        """The pre-update slots of `p`, read on the host, as a StepStats (kept as `p.stats`)."""
        stats = StepStats(step=p.step, lr=p.lr)
        slots = p.pre.decode(values)
        if "loss" in slots:
            stats.loss = slots["loss"][0]
        if "clip" in slots:
            stats.clip_norm = slots["clip"][0]
        self.probe.decode_pre(slots.get("grad", []), p.grad_layout, stats)
        if p.act_names:
            stats.activations = dict(zip(p.act_names, slots.get("act", []), strict=True))
            if self.act_probe:
                dtypes = {self.act_probe.dtypes[m] for m in p.act_names
                          if m in self.act_probe.dtypes}
                stats.act_limit = min((dtype_max(d) for d in dtypes), default=None)
        self.batch_probe.decode_taken(slots, p.batch, stats)
        if p.loaded:
            flags = slots["loaded"]
            if stats.nonfinite_samples or stats.nonfinite_tensors:
                # This step's forward read a non-finite batch: buffers it writes (BatchNorm's
                # running statistics) hold the value because of the batch, not of a load.
                flags = [1.0 if n.startswith("buffer:") else f
                         for n, f in zip(p.loaded, flags, strict=True)]
            elif not all(flags):
                # Running statistics of a BatchNorm in training mode were written by this
                # step's forward: not loaded state; the post-update check warns of them.
                written = unread.training_names()
                flags = [1.0 if n.removeprefix("buffer:") in written else f
                         for n, f in zip(p.loaded, flags, strict=True)]
            self._on_loaded(p.step, p.loaded, flags)
        if "attn" in slots:
            stats.attn_logit_max = slots["attn"][0]
        if "scale" in slots:
            stats.amp_scale = slots["scale"][0]
        if "found_inf" in slots:
            p.found_inf = bool(slots["found_inf"][0])
        if self.batch_probe.dropped is not None:
            stats.dropped_samples, self.batch_probe.dropped = self.batch_probe.dropped, None
        if live and stats.nonfinite_grads and any(
                math.isinf(stats.grad_norms[i]) for i in stats.nonfinite_grads):
            self.probe.resolve_overflow(stats)  # rare: an extra read only here
        p.stats = stats
        return stats

    def leftover(self, step: int, device: torch.device,
                 loss: torch.Tensor | None) -> StepStats | None:
        """At close: the loss and batch handed to `watch` after the last optimizer step, read
        (one host read) and checked element by element; None when there is neither.

        First, when the last step read did not measure the optimizer state, it is measured
        now (it is still that step's): a non-finite state returns that step's statistics,
        with the state's norms in them, for the finding (`watch.sampling`)."""
        sampler = self.sampler
        last = sampler.last
        if last is not None and not sampler.last_state and self.probe.holds_state():
            sampler.counts["close"] += 1
            sampler.last_state = True
            now = StepStats(step=last.step)
            self.state_now(now)
            self.probe.resolve_post_overflow(now)  # an overflow of finite values is no NaN
            if any(s.startswith("optimizer.") for s in now.nonfinite_signals()):
                last.state_norms = now.state_norms  # the state after that step
                last.unseal()
                return last
        if loss is None and not self.batch_probe.parts:
            return None
        stats = StepStats(step=step)
        packet = Packet(device)
        if loss is not None:
            packet.add("loss", loss)
        size, vec = self.batch_probe.collect()
        if vec is not None:
            packet.add("batch", vec)
        slots = packet.read(self.read)
        if "loss" in slots:
            stats.loss = slots["loss"][0]
        self.batch_probe.decode(slots.get("batch", []), size, stats)
        return stats
