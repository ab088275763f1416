"""What the post-update pass measures, worked out once per signature.

After every `optimizer.step()` the probe measures the parameters, each optimizer-state tensor
shaped like its parameter (momentum, Adam's two moments) and the model's floating-point
buffers. Which tensors those are, in which order, and how their norms come back, depends only
on the *signature*: the parameter list, which state dict each parameter has and which tensors
those dicts hold. `PostLayout` computes that once; each step `fits` checks, with C-level passes
only (`map` over identities, no Python call per tensor), that the signature is unchanged, and
the same flat tensor list is measured again. Anything that changes it (the optimizer's first
step creating its state, `load_state_dict` replacing the state, `add_param_group`, a state
tensor replaced by another, a new state key) fails the check and the layout is built again.

What is not re-checked each step is a tensor changing shape in place (`p.data = <another
shape>`, `resize_`): the layout keeps measuring the tensors it chose (any tensor's norm is
still that tensor's norm; values are never wrong). Through a plan (below), a changed shape or
dtype no longer stacks and the layout is built afresh, without a plan.

Many small CPU tensors in few shapes are measured through one `NormPlan` for the whole pass
(parameters, moments and buffers together: one stack and one reduction per shape); the norms
then come back in the plan's group order and `decode` puts them in place on the host.

The optimizer state is sampled (`WatchConfig.sample_every`, DESIGN section 8): a layout is
built with the state (`state_too`: the sampled steps) or without it (the parameters and
buffers only: every other step); the probe keeps one of each, so alternating between them
rebuilds nothing. A NaN that enters the state reaches the parameters at the same update (SGD's
`p -= lr * buf`, Adam's `m / sqrt(v)`), where the every-step pass sees it; what the parameters
do not show (an `exp_avg_sq` overflowing to inf only zeroes its updates) is seen at the next
sampled step.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from nanguard.watch.norms import NormPlan, Norms, dtensor_type, norm_values

# Optimizer state entries that are tensors shaped like the parameter, by meaning.
FIRST_MOMENT_KEYS = ("momentum_buffer", "exp_avg")
SECOND_MOMENT_KEYS = ("exp_avg_sq", "square_avg", "sum")

_is = operator.is_


class PostLayout:
    """The tensors of one post-update pass, their slots and how to decode their norms.

    Args:
        params: the parameters (index = parameter id).
        state: the optimizer's `state` (parameter -> its state dict).
        buffers: the model's watched floating-point buffers.
        second_moments: whether second-moment keys (`SECOND_MOMENT_KEYS`) are measured.
        plan: measure through a `NormPlan` when one pays (False: a plan stopped fitting).
        state_too: whether the optimizer state is measured at all (False: the parameters
            and buffers only, the steps between samples).

    Attributes:
        slots: (`param`, `state.<key>` or `buffer`; the parameter or buffer indices) in the
            order their norms come back.
        tensors: every tensor measured, in slot order.
    """

    def __init__(self, params: list[torch.Tensor], state: Any, buffers: list[torch.Tensor],
                 second_moments: bool, plan: bool = True, state_too: bool = True) -> None:
        self.params = params
        self.buffers = buffers
        self.second_moments = second_moments
        self.state_too = state_too
        self._state = state
        # The state dicts in the optimizer's own order (`values()`: no tensor hashing, which
        # is a Python call per parameter): a dict replaced, added or removed shows there.
        self._dicts = list(state.values()) if state_too else []
        self._entries = sum(map(len, self._dicts))
        held: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        by_key: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        for i, p in enumerate(params if state_too else ()):
            st = state.get(p)
            for key, value in (st or {}).items():
                if not isinstance(value, torch.Tensor):
                    continue
                held.append((st, key, value))
                if key in SECOND_MOMENT_KEYS and not second_moments:
                    continue
                # (`step` is a 0-dim counter: it matches a 0-dim parameter's shape.)
                if key != "step" and value.shape == p.shape and value.numel():
                    ids, tensors = by_key.setdefault(key, ([], []))
                    ids.append(i)
                    tensors.append(value)
        # Every tensor a parameter's state dict holds is checked each step (identity), measured
        # or not: one replaced by another changes the layout.
        self._held_dicts = [h[0] for h in held]
        self._held_keys = [h[1] for h in held]
        self._held = [h[2] for h in held]
        # Named `state.<key>` (slot and layout alike): a state key called `param` or `update`
        # (a custom optimizer's) cannot be taken for the parameters or the update norm.
        groups = [("param", list(range(len(params))), params)]
        groups += [(f"state.{key}", ids, tensors) for key, (ids, tensors) in by_key.items()]
        if buffers:
            groups.append(("buffer", list(range(len(buffers))), buffers))
        self.slots: list[tuple[str, list[int]]] = [(key, ids) for key, ids, _ in groups]
        self.tensors: list[torch.Tensor] = [t for _, _, ts in groups for t in ts]
        spans, pos = [], 0
        for key, ids in self.slots:
            spans.append((key, ids, pos, pos + len(ids)))
            pos += len(ids)
        self.spans = spans
        """(slot name, indices, first, end) of each slot's values in `decode`'s list."""
        self.plan = NormPlan(self.tensors) if plan and NormPlan.worth(self.tensors) else None
        self.perm: list[int] | None = None
        """Where each tensor's norm sits in the plan's group order (None: no plan)."""
        if self.plan is not None:  # norms come in group order: where each tensor's sits
            perm = [0] * len(self.tensors)
            for k, i in enumerate(self.plan.order):
                perm[i] = k
            self.perm = perm
        dt = dtensor_type()
        self.plain = self.plan is None and all(
            t.layout == torch.strided and (dt is None or not isinstance(t, dt))
            for t in self.tensors)
        """No plan, and every tensor dense and local (decided once: neither changes in
        place): `_foreach_norm` measures them whenever their dtypes are float32-normed
        (`watch.lane` checks the dtypes each step, in C)."""

    def fits(self, params: list[torch.Tensor], state: Any, buffers: list[torch.Tensor],
             second_moments: bool) -> bool:
        """Whether this layout is still what a fresh pass would build: the same parameter and
        buffer lists, the same optimizer state object holding the same state dicts (in order),
        with as many entries as they had, the same tensors under the same keys. C-level
        passes only (~10 us for 400 parameters with momentum). A layout without the state
        checks the parameter and buffer lists only."""
        if not self.state_too:
            return params is self.params and buffers is self.buffers
        return (params is self.params and buffers is self.buffers
                and second_moments == self.second_moments and state is self._state
                and len(state) == len(self._dicts)
                and all(map(_is, state.values(), self._dicts))
                and sum(map(len, self._dicts)) == self._entries
                and all(map(_is, map(dict.get, self._held_dicts, self._held_keys), self._held)))

    def norms(self) -> Norms | None:
        """The device norms of `tensors`, in one pass (one plan, or one `norm_values` call);
        None when the plan no longer fits them (a dtype changed): the caller builds a layout
        without a plan (this one stays as it is: steps measured with it decode with it)."""
        if self.plan is not None:
            return self.plan.grouped(self.tensors)
        return norm_values(self.tensors)

    def decode(self, values: list[float]) -> tuple[dict[int, float], dict[str, dict[int, float]],
                                                   dict[int, float]]:
        """The host values of `norms()` as (parameter norms, state norms by key, buffer norms).
        The plan's values are put back in slot order first (C-level)."""
        if self.perm is not None:
            values = list(map(values.__getitem__, self.perm))
        params: dict[int, float] = {}
        buffers: dict[int, float] = {}
        state: dict[str, dict[int, float]] = {}
        for key, ids, a, b in self.spans:
            norms = dict(zip(ids, values[a:b], strict=True))
            if key == "param":
                params = norms
            elif key == "buffer":
                buffers = norms
            else:
                state[key[len("state."):]] = norms
        return params, state, buffers

