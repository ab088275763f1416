"""Fused, device-side norms of parameters, gradients, optimizer state and buffers.

The probe never reads a value on the host by itself: `pre_step` returns the gradient norms and
`post_step` adds the parameter, state and buffer norms to the step's packet, on the device (as
`_foreach_norm` gives them: 0-dim float32 norms, stacked once with the rest of the packet); the
guard reads the packet once (`decode_pre` / `decode_post` turn the host values back into a
`StepStats`, `watch.stats`). Norms are float32 `_foreach_norm`s (float64 and complex tensors in
their own precision, sparse gradients by their values): a NaN norm means some element is NaN; an
infinite norm means an element is infinite OR the sum of squares overflowed while every element
is finite (seen one step before the first NaN in the LR/momentum cascade). `resolve_overflow`
tells the two apart, with an extra read only in that rare case.
"""

from __future__ import annotations

import math
import operator
from itertools import repeat

import torch
from torch import nn

from nanguard.watch import unread
from nanguard.watch.layout import PostLayout
from nanguard.watch.norms import NormPlan, Norms, dense_values, is_dtensor, local, norm_values
from nanguard.watch.packet import Packet
from nanguard.watch.stats import StepStats

_GRAD = operator.attrgetter("grad")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


class StepProbe:
    """Computes the per-step statistics of one optimizer's parameters on their device.

    Args:
        params: the parameters the optimizer updates, in a fixed order (index = parameter id).
        optimizer: the optimizer whose state (momentum, Adam moments) is measured after the step.
    """

    def __init__(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                 buffers: list[torch.Tensor] | None = None) -> None:
        self.params = params
        self.optimizer = optimizer
        self.buffers: list[torch.Tensor] = buffers or []
        """Floating-point buffers of the model, measured after every step."""
        self._update_buf: list[torch.Tensor] | None = None
        self._with_update = False
        self.plan: NormPlan | None = None
        """The gradients' `NormPlan` (None: `_foreach_norm`), decided for `plan_for`."""
        self.plan_for: list[torch.Tensor] | None = None
        """The parameter list `plan` was decided for (another list: decided again)."""
        self._sharded = any(map(is_dtensor, params))
        """Whether a parameter is a DTensor (decided once per parameter list: a parameter
        does not become one, or stop being one, in place)."""
        self.layout: PostLayout | None = None
        """What the post-update pass measures on a sampled step (the optimizer state too),
        kept while its signature holds."""
        self.bare: PostLayout | None = None
        """The same on the steps between samples: the parameters and buffers only."""
        self.all_idx: list[int] = []
        """`range(len(params))` as a list, the gradient layout of a step where every parameter
        has a gradient (read only by the decoder)."""

    def follow(self, params: list[torch.Tensor]) -> None:
        """Measure `params` from the next step on: called by the step pipeline's pre-hook when
        the optimizer holds other parameters than before (`add_param_group` after the guard
        was built). The update-ratio copy is reallocated for them at the next sample."""
        self.params = params
        self._sharded = any(map(is_dtensor, params))
        self._update_buf = None

    def _locals(self) -> list[torch.Tensor]:
        """The parameters as local tensors (each DTensor's shard; the list as it is when none
        is a DTensor, decided once)."""
        return [local(p) for p in self.params] if self._sharded else self.params

    def norms_of(self, tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None
               ) -> Norms:
        """`norm_values(tensors)`, through a `NormPlan` when the tensors are aligned with the
        parameters and there are many small ones on the CPU."""
        if len(tensors) == len(self.params):
            if self.plan_for is not self.params:  # new parameters (`_sync_params`)
                self.plan_for = self.params
                self.plan = NormPlan(self.params) if NormPlan.worth(self.params) else None
            if self.plan is not None:
                norms = self.plan.norms(tensors)
                if norms is not None:
                    return norms
                self.plan = None  # no longer fits: `_foreach_norm` from here on
        return norm_values(tensors, like=like)

    def pre_step(self, snapshot_update: bool) -> tuple[Norms | None, list[int]]:
        """Runs after backward (and any clipping), before `optimizer.step()` changes anything.

        Returns the per-parameter gradient norms (on the device, as `norm_values` gives them;
        None when no parameter has a gradient) and the layout: the indices of the parameters
        they belong to. When `snapshot_update` is set, copies the parameters into a buffer
        allocated once, so that `post_step` can measure the update.
        """
        every = list(map(_GRAD, self.params))  # C-level: no call per parameter
        if any(map(operator.is_, every, repeat(None))):
            idx = [i for i, g in enumerate(every) if g is not None]
        else:  # every parameter has a gradient (the common step): one index list, kept
            if len(self.all_idx) != len(every):
                self.all_idx = list(range(len(every)))
            idx = self.all_idx
        self._with_update = snapshot_update and bool(idx)
        if self._with_update:
            # The local tensors (`_locals`, inline: the list as it is without a DTensor).
            mine = self._locals() if self._sharded else self.params
            buf = self._update_buf
            if buf is not None and (
                    any(map(operator.ne, map(_DTYPE, buf), map(_DTYPE, mine)))
                    or any(map(operator.ne, map(_SHAPE, buf), map(_SHAPE, mine)))
            ):  # the model was converted (`.double()`, `.to()`) after the guard was built
                self._update_buf = None
            if self._update_buf is None:
                self._update_buf = [torch.empty_like(p) for p in mine]
            with torch.no_grad():
                torch._foreach_copy_(self._update_buf, mine)
        if not idx:
            return None, idx
        grads = every if len(idx) == len(every) else [every[i] for i in idx]
        return self.norms_of(grads), idx

    def post_step(self, packet: Packet, second_moments: bool = True, state: bool = True
                  ) -> PostLayout:
        """Runs right after `optimizer.step()`: adds to `packet` the parameter norms, the
        optimizer-state norms (only when `state`: a sampled step, `WatchConfig.sample_every`;
        per state key; second moments only when `second_moments`) and buffer norms, all from
        one norm pass (slot `post`), and, on sampled steps, the update norm (`update`).
        Returns the layout `decode_post` reads them back with: built once per signature
        (`watch.layout`), reused while the optimizer state holds the same tensors."""
        # No autograd records for the parameters' reductions (the hook runs in the user's grad
        # mode): one context instead of a `detach()` per parameter.
        with torch.no_grad():
            return self._post_step(packet, second_moments, state)

    def post_norms(self, second_moments: bool = True, state: bool = True
                   ) -> tuple[Norms, PostLayout]:
        """`post_step` without a packet, for a step with no update norm (the quiet lane,
        `watch.lane`): the device norms of the post-update pass and the layout to decode
        them with."""
        with torch.no_grad():
            return self._post_norms(second_moments, state)

    def post_layout(self, state: bool, second_moments: bool = True) -> PostLayout:
        """The layout of this step's post-update pass (with the optimizer state when `state`):
        the one kept while it fits (`PostLayout.fits`), else a new one, kept."""
        lay = self.layout if state else self.bare
        if lay is None or not lay.fits(self.params, self.optimizer.state, self.buffers,
                                       second_moments):
            lay = PostLayout(self.params, self.optimizer.state, self.buffers, second_moments,
                             state_too=state)
            self.keep(lay)
        return lay

    def keep(self, lay: PostLayout) -> None:
        """Keep `lay` as the layout of its kind (with the state or without)."""
        if lay.state_too:
            self.layout = lay
        else:
            self.bare = lay

    def layout_norms(self, lay: PostLayout) -> tuple[Norms, PostLayout]:
        """`lay`'s device norms, and the layout to decode them with: `lay`, or, when its plan
        no longer fits (a dtype changed), a layout without a plan (kept from now on)."""
        norms = lay.norms()
        if norms is None:
            lay = PostLayout(self.params, self.optimizer.state, self.buffers,
                             lay.second_moments, plan=False, state_too=lay.state_too)
            self.keep(lay)
            norms = lay.norms()
            assert norms is not None
        return norms, lay

    def _post_norms(self, second_moments: bool, state: bool) -> tuple[Norms, PostLayout]:
        return self.layout_norms(self.post_layout(state, second_moments))

    def holds_state(self) -> bool:
        """Whether the optimizer holds a state tensor a sampled step measures (one shaped like
        its parameter): plain SGD holds none, and then there is nothing to sample. A loop over
        the parameters: asked only at close and on a step gone non-finite."""
        state = self.optimizer.state
        return any(isinstance(v, torch.Tensor) and k != "step" and v.numel() and v.shape == p.shape
                   for p in self.params for k, v in (state.get(p) or {}).items())

    def _post_step(self, packet: Packet, second_moments: bool, state: bool) -> PostLayout:
        norms, lay = self._post_norms(second_moments, state)
        packet.add("post", norms)
        if self._with_update:
            assert self._update_buf is not None
            # In place: no transient parameter-sized allocation.
            torch._foreach_sub_(self._update_buf,
                                self._locals() if self._sharded else self.params)
            upd = self.norms_of(self._update_buf, like=self.params)
            stacked = torch.stack(upd) if isinstance(upd, (list, tuple)) else upd
            packet.add("update", stacked.double().pow(2).sum().sqrt())
        self._with_update = False
        return lay

    @staticmethod
    def decode_pre(values: list[float], layout: list[int], stats: StepStats) -> None:
        """Fill `stats` from the host copy of `pre_step`'s norms."""
        norms = dict(zip(layout, values, strict=True))
        stats.grad_norms = norms
        # Norms are >= 0: a finite float64 sum means every one is finite (the quiet step).
        if not math.isfinite(sum(values)):
            stats.nonfinite_grads = {i for i, v in norms.items() if not math.isfinite(v)}

    @staticmethod
    def decode_post(slots: dict[str, list[float]], layout: PostLayout, stats: StepStats
                    ) -> None:
        """Fill `stats` from the host copy of the slots `post_step` added."""
        stats.unseal()
        stats.param_norms, stats.state_norms, stats.buffer_norms = layout.decode(slots["post"])
        update = slots.get("update")
        if update is not None:
            stats.update_norm = update[0]

    def resolve_post_overflow(self, stats: StepStats) -> None:
        """Same as `resolve_overflow`, for parameter and optimizer-state norms after the step.

        Parameters of ~1e20 have an infinite float32 norm while every value is finite (one step
        before the NaN in the cascade); calling them non-finite would blame the optimizer for
        a value it has not produced yet. Runs only when such a norm came back infinite.
        """
        # Norms are >= 0 (float32 norms: their float64 sum cannot overflow): a finite sum of
        # them all means none is infinite (the every-step case), in C-level passes.
        if math.isfinite(sum(stats.param_norms.values()) + sum(stats.buffer_norms.values())
                         + sum(map(sum, map(dict.values, stats.state_norms.values())))):
            return
        groups: list[tuple[dict[int, float], str | None]] = [(stats.param_norms, None)]
        groups += [(norms, key) for key, norms in stats.state_norms.items()]
        groups.append((stats.buffer_norms, "buffer"))
        stats.unseal()
        for norms, key in groups:
            for i, v in list(norms.items()):
                if not math.isinf(v):
                    continue
                if key == "buffer":
                    t = self.buffers[i]
                else:
                    p = self.params[i]
                    t = p.detach() if key is None else self.optimizer.state[p][key]
                t64 = dense_values(t)
                if bool(torch.isfinite(t64).all()):
                    norms[i] = float(torch.linalg.vector_norm(t64))
                    if key != "buffer":
                        stats.overflowed.add(i)
        unread.set_aside(stats, self.buffers)

    def resolve_overflow(self, stats: StepStats) -> None:
        """Tell "the float32 sum of squares overflowed" from "an element is infinite".

        Runs only when some gradient norm came back infinite (never on a healthy step); it reads
        each such gradient's abs-max and recomputes its norm in float64.
        """
        stats.unseal()
        for i in sorted(stats.nonfinite_grads):
            if not math.isinf(stats.grad_norms[i]):
                continue
            grad = self.params[i].grad
            if grad is None:
                continue
            if is_dtensor(grad):
                grad = grad.full_tensor()  # type: ignore[attr-defined]  # every rank is here: the norms were all-reduced
            g = dense_values(grad)
            if bool(torch.isfinite(g).all()):
                stats.grad_norms[i] = float(torch.linalg.vector_norm(g))
                stats.nonfinite_grads.discard(i)
                stats.overflowed.add(i)


def watched_buffers(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The model's floating-point buffers that hold no infinity when the guard is built.

    BatchNorm running statistics must stay finite (an inf running variance makes every eval
    NaN); a causal attention mask legitimately holds -inf and is left out. A NaN is never
    intended, so a buffer holding one is watched (and reported as loaded state). One host
    read, here only."""
    named = [(n, b) for n, b in model.named_buffers() if b.is_floating_point() and b.numel()]
    if not named:
        return [], []
    with torch.no_grad():
        has_inf = torch.stack([torch.isinf(local(b)).any().cpu() for _, b in named]).tolist()
    kept = [(n, b) for (n, b), inf in zip(named, has_inf, strict=True) if not inf]
    unread.note(model)
    return [n for n, _ in kept], [b for _, b in kept]
