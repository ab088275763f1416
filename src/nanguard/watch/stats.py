"""Fused, device-side statistics of parameters, gradients and optimizer state.

The probe never reads a value on the host by itself: `pre_step` returns the gradient norms and
`post_step` adds the parameter, state and buffer norms to the step's packet, on the device (as
`_foreach_norm` gives them: 0-dim float32 norms, stacked once with the rest of the packet); the
guard reads the packet once (`decode_pre` / `decode_post` turn the host values back into a
`StepStats`). Norms are float32 `_foreach_norm`s
(float64 and complex tensors in their own precision, sparse gradients by their values):
a NaN norm means some element is NaN; an infinite norm means an element is infinite OR the sum of
squares overflowed while every element is finite (seen one step before the first NaN in the
LR/momentum cascade). `resolve_overflow` tells the two apart, with an extra read only in that
rare case.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, overload

import torch
from torch import nn

from nanguard.record.writer import RawHashes, combine_sums
from nanguard.watch import unread
from nanguard.watch.layout import FIRST_MOMENT_KEYS, SECOND_MOMENT_KEYS, PostLayout
from nanguard.watch.norms import NormPlan, Norms, dense_values, is_dtensor, local, norm_values
from nanguard.watch.packet import Packet


def _any_nonfinite(norms: dict[int, float], key: str, overflowed: set[tuple[str, int]]) -> bool:
    """Whether a norm other than a known float32 overflow is NaN or infinite. Norms are >= 0,
    so their float64 sum (one C-level pass) is finite exactly when every norm is."""
    if math.isfinite(sum(norms.values())):
        return False
    return any(not math.isfinite(v) for i, v in norms.items() if (key, i) not in overflowed)


class _Hashes:
    """`StepStats.sample_hashes`: a list of fingerprints, or, on a CPU step whose per-tensor
    sums the host combines, those sums kept as they were read (`StepStats.defer_hashes`) and
    combined the first time the list is read. A quiet step's are never read on the training
    thread: the run store's writer combines them (`record.writer`)."""

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> tuple[int, ...]: ...
    @overload
    def __get__(self, obj: StepStats, owner: type | None = None) -> list[int]: ...

    def __get__(self, obj: StepStats | None, owner: type | None = None
                ) -> list[int] | tuple[int, ...]:
        if obj is None:
            return ()  # the dataclass's default (an immutable one)
        v = obj.__dict__["_hashes"]
        if type(v) is tuple:
            v = obj.__dict__["_hashes"] = combine_sums(v)
        return v

    def __set__(self, obj: StepStats, value: list[int] | tuple[int, ...]) -> None:
        obj.__dict__["_hashes"] = list(value)


HASHES_SLOT = "_hashes"
"""Where a `StepStats` holds its sample fingerprints as they are (`_Hashes`): a caller that
may need them later keeps `stats.__dict__.get(HASHES_SLOT, [])` (no read, no call on the quiet
path) and gives it to `combined_hashes` when it does."""


def combined_hashes(kept: list[int] | RawHashes) -> list[int]:
    """The fingerprints of a value kept from `HASHES_SLOT` (combined here if not yet)."""
    return combine_sums(kept) if isinstance(kept, tuple) else list(kept)


@dataclass(kw_only=True)
class StepStats:
    """Host-side statistics of one optimizer step. NaN / inf are kept as they are."""

    step: int
    loss: float | None = None
    grad_norms: dict[int, float] = field(default_factory=dict)
    """Per-parameter gradient L2 norm, by parameter index (only parameters that had a grad)."""
    param_norms: dict[int, float] = field(default_factory=dict)
    """Per-parameter L2 norm after the step."""
    state_norms: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per optimizer-state key (`exp_avg`, `exp_avg_sq`, `momentum_buffer`, ...): per-parameter
    L2 norm after the step."""
    buffer_norms: dict[int, float] = field(default_factory=dict)
    """Per floating-point buffer of the model (BatchNorm running statistics, ...): L2 norm
    after the step, by buffer index. A running variance at inf makes every eval NaN."""
    unread_nonfinite: dict[int, str] = field(default_factory=dict)
    """Buffers (index -> name) non-finite after the step that training does not read
    (`watch.unread`: BatchNorm running statistics in training mode): a warning, left out of
    `nonfinite_signals`."""
    update_norm: float | None = None
    """L2 norm of the whole update (sampled steps only)."""
    activations: dict[str, float] = field(default_factory=dict)
    """Per-module activation abs-max (when activation watching is on and sampled)."""
    act_limit: float | None = None
    """Largest finite value of the narrowest dtype those activations were computed in."""
    attn_logit_max: float | None = None
    """Largest |attention logit| of the step's forward (sampled with the activations; None
    where the model has no attention or it was not measured: `watch.attention`)."""
    sample_hashes: _Hashes = _Hashes()
    """52-bit fingerprints of each sample of the batch handed to the guard (a list of ints;
    combined when first read after `defer_hashes`)."""
    nonfinite_samples: list[int] = field(default_factory=list)
    """Indices of the samples of the batch that hold a NaN or Inf."""
    dropped_samples: list[int] = field(default_factory=list)
    """NaN rows of an earlier batch of this step whose update the GradScaler skipped (see
    `BatchProbe.dropped`)."""
    batch_tensors: int = 0
    """Number of tensors in the batch handed to the guard (inputs first, targets last)."""
    nonfinite_tensors: list[int] = field(default_factory=list)
    """Indices of those tensors that hold a NaN or Inf."""
    lr: float | None = None
    overflowed: set[int] = field(default_factory=set)
    """Parameters whose gradient norm overflowed float32 although every element is finite."""
    nonfinite_grads: set[int] = field(default_factory=set)
    overflow_norms: set[tuple[str, int]] = field(default_factory=set)
    """(`param` or a state key, index) whose infinite norm is known to be a float32 overflow of
    finite values (see `assume_overflow`)."""
    skipped: bool = False
    amp_scale: float | None = None
    """The GradScaler's loss scale at this step (when a scaler was given to the guard)."""
    amp_skipped: int = 0
    """Steps the GradScaler skipped (fp16 overflow) since the previous step the guard saw."""
    agreed_bad_rank: int | None = None
    """Under torch.distributed: the rank where a non-finite value showed first this step
    (earliest phase, then lowest rank)."""
    alarms: list[Any] = field(default_factory=list)
    """Alarms raised on this step (filled by the guard)."""
    _signals: list[str] | None = field(default=None, repr=False, compare=False)
    """`nonfinite_signals()` as of the last `seal()`: the guard seals a step once its values are
    decoded, and the detectors, the policy and the record then read it without rescanning."""

    _derived: dict[str, float | None] = field(default_factory=dict, repr=False, compare=False)
    """The global norms computed since the last `seal()` (each asked for by several
    detectors, the policy and the record)."""

    def defer_hashes(self, raw: RawHashes) -> None:
        """Keep the batch's per-tensor sums as read; `sample_hashes` combines them when read."""
        self.__dict__["_hashes"] = raw

    def raw_hashes(self) -> RawHashes | list[int]:
        """The fingerprints as they are kept: still-raw sums (`defer_hashes`), or the list."""
        v: RawHashes | list[int] = self.__dict__["_hashes"]
        return v

    def seal(self) -> list[str]:
        """Compute `nonfinite_signals()` once and keep it, and the global norms once asked,
        until the values change again (decoding, `assume_overflow` and the overflow checks
        unseal)."""
        if self._signals is None:
            # The three globals every quiet step asks for (the gate, the record: through
            # `global_norms`), as `_sealed_global` computes them, here: no call each.
            g, p = self.grad_norms, self.param_norms
            gv, pv = g.values(), p.values()
            m = None
            for key in FIRST_MOMENT_KEYS:
                if key in self.state_norms:
                    mn = self.state_norms[key]
                    mv = mn.values()
                    m = math.sqrt(sum(map(operator.mul, mv, mv))) if mn else 0.0
                    break
            self._derived = {
                "grad_norm": math.sqrt(sum(map(operator.mul, gv, gv))) if g else 0.0,
                "param_norm": math.sqrt(sum(map(operator.mul, pv, pv))) if p else 0.0,
                "momentum_norm": m}
            self._signals = self.nonfinite_signals()
        return self._signals

    def global_norms(self) -> tuple[float, float, float | None]:
        """(`grad_norm`, `param_norm`, `momentum_norm`) in one call: what the quiet gate and
        the record both ask for (kept by `seal`)."""
        if self._signals is not None:
            d: Any = self._derived  # floats but for the momentum (None without)
            return d["grad_norm"], d["param_norm"], d["momentum_norm"]
        return self.grad_norm, self.param_norm, self.momentum_norm

    @staticmethod
    def _global(norms: dict[int, float]) -> float:
        # sum(v * v for v ...) with the products made in C: the same floats in the same order.
        vals = norms.values()
        return math.sqrt(sum(map(operator.mul, vals, vals))) if norms else 0.0

    def _sealed_global(self, name: str, norms: dict[int, float]) -> float:
        """`_global(norms)`, kept under `name` once sealed. The quiet step's path asks each
        global ~2 times: computed inline (no nested call), as `_global` does."""
        if self._signals is None:
            return self._global(norms)
        d = self._derived
        v = d.get(name)
        if v is None:
            vals = norms.values()
            v = d[name] = math.sqrt(sum(map(operator.mul, vals, vals))) if norms else 0.0
        return v

    @property
    def grad_norm(self) -> float:
        """Global gradient L2 norm, computed in float64 on the host (no overflow). Once sealed,
        computed once (the detectors, the policy and the record all ask for it)."""
        # `_sealed_global`'s fast path inline: one call per ask on the quiet step, not two.
        v = self._derived.get("grad_norm") if self._signals is not None else None
        return v if v is not None else self._sealed_global("grad_norm", self.grad_norms)

    @property
    def param_norm(self) -> float:
        v = self._derived.get("param_norm") if self._signals is not None else None
        return v if v is not None else self._sealed_global("param_norm", self.param_norms)

    @property
    def momentum_norm(self) -> float | None:
        """Global L2 norm of the first moment (`momentum_buffer` / `exp_avg`), None when the
        optimizer keeps none; once sealed, computed once."""
        d = self._derived
        if self._signals is not None and "momentum_norm" in d:
            return d["momentum_norm"]
        v = None
        for key in FIRST_MOMENT_KEYS:
            if key in self.state_norms:
                v = self._sealed_global("momentum_norm", self.state_norms[key])
                break
        if self._signals is not None:
            d["momentum_norm"] = v
        return v

    @property
    def second_moment_norm(self) -> float | None:
        """Global L2 norm of the optimizer's second moments (Adam `exp_avg_sq`, RMSprop
        `square_avg`, Adagrad `sum`), from the per-tensor norms already read; None without."""
        for key in SECOND_MOMENT_KEYS:
            if key in self.state_norms:
                return self._sealed_global("second_moment_norm", self.state_norms[key])
        return None

    @property
    def update_ratio(self) -> float | None:
        if self.update_norm is None:
            return None
        pn = self.param_norm
        return self.update_norm / pn if pn > 0 else math.inf

    @property
    def act_max(self) -> float | None:
        return max(self.activations.values()) if self.activations else None

    @property
    def act_headroom(self) -> float | None:
        """Decades of growth left before the largest activation overflows its dtype:
        log10(dtype max / activation abs-max). Negative infinity once it has."""
        top, limit = self.act_max, self.act_limit
        if top is None or not limit:
            return None
        if not math.isfinite(top):
            return -math.inf
        return math.inf if top <= 0 else math.log10(limit) - math.log10(top)

    def record(self) -> dict[str, Any]:
        """The magnitudes of this step a diagnosis reads (`Guard.run_log()["history"]`): `step`,
        `loss`, `grad_norm` (global; None when no gradient was measured), `act_max` (largest
        finite activation abs-max), `lr` and `update_ratio` (None on steps not sampled). Plain
        floats, NaN/Inf kept."""
        acts = [v for v in self.activations.values() if math.isfinite(v)]
        return {"step": self.step, "loss": self.loss,
                "grad_norm": self.grad_norm if self.grad_norms else None,
                "act_max": max(acts) if acts else None, "lr": self.lr,
                "update_ratio": self.update_ratio}

    def assume_overflow(self) -> None:
        """Call infinite (not NaN) norms overflows of finite values. Sound when the parameters
        are known finite after this step: a non-finite gradient, parameter or state value
        would have made them non-finite for good (NaN and inf are absorbing in SGD / Adam
        updates), so an infinite norm here can only be a float32 sum of squares overflowing."""
        self._signals = None
        for i in [i for i in self.nonfinite_grads if math.isinf(self.grad_norms[i])]:
            self.nonfinite_grads.discard(i)
            self.overflowed.add(i)
        for key, norms in [("param", self.param_norms), *self.state_norms.items()]:
            self.overflow_norms |= {(key, i) for i, v in norms.items() if math.isinf(v)}

    def unseal(self) -> None:
        """Forget what `seal` kept. Called by whoever changes a sealed step's values from
        outside this module (the state norms decoded late, a buffer set aside, activations
        of a skipped forward dropped); the next `seal` scans again."""
        self._signals = None

    def nonfinite_signals(self) -> list[str]:
        """Names of the signals that hold a non-finite value this step."""
        if self._signals is not None:
            return list(self._signals)
        out = []
        if self.dropped_samples:
            out.append("data")
        if self.loss is not None and not math.isfinite(self.loss):
            out.append("loss")
        if self.nonfinite_grads:
            out.append("grad")
        over = self.overflow_norms
        # Norms are >= 0: a finite float64 sum means every one is finite (the quiet step,
        # without a call per group).
        if (not math.isfinite(sum(self.param_norms.values()))
                and _any_nonfinite(self.param_norms, "param", over)):
            out.append("param")
        for key, norms in self.state_norms.items():
            if not math.isfinite(sum(norms.values())) and _any_nonfinite(norms, key, over):
                out.append(f"optimizer.{key}")
        if not math.isfinite(sum(self.buffer_norms.values())) and any(
                not math.isfinite(v) for i, v in self.buffer_norms.items()
                if i not in self.unread_nonfinite):
            out.append("buffer")
        if not math.isfinite(sum(self.activations.values())):
            out.append("activation")
        return out


_GRAD = operator.attrgetter("grad")


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
        self._plan: NormPlan | None = None
        self._plan_for: list[torch.Tensor] | None = None
        self._layout: PostLayout | None = None
        """What the post-update pass measures on a sampled step (the optimizer state too),
        kept while its signature holds."""
        self._bare: PostLayout | None = None
        """The same on the steps between samples: the parameters and buffers only."""
        self._all_idx: list[int] = []
        """`range(len(params))` as a list, the gradient layout of a step where every parameter
        has a gradient (read only by the decoder)."""

    def follow(self, params: list[torch.Tensor]) -> None:
        """Measure `params` from the next step on: called by the step pipeline's pre-hook when
        the optimizer holds other parameters than before (`add_param_group` after the guard
        was built). The update-ratio copy is reallocated for them at the next sample."""
        self.params = params
        self._update_buf = None

    def _norms(self, tensors: list[torch.Tensor], like: list[torch.Tensor] | None = None
               ) -> Norms:
        """`norm_values(tensors)`, through a `NormPlan` when the tensors are aligned with the
        parameters and there are many small ones on the CPU."""
        if len(tensors) == len(self.params):
            if self._plan_for is not self.params:  # new parameters (`_sync_params`)
                self._plan_for = self.params
                self._plan = NormPlan(self.params) if NormPlan.worth(self.params) else None
            if self._plan is not None:
                norms = self._plan.norms(tensors)
                if norms is not None:
                    return norms
                self._plan = None  # no longer fits: `_foreach_norm` from here on
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
            if len(self._all_idx) != len(every):
                self._all_idx = list(range(len(every)))
            idx = self._all_idx
        self._with_update = snapshot_update and bool(idx)
        if self._with_update:
            if self._update_buf is not None and any(
                b.dtype != p.dtype or b.shape != local(p).shape
                for b, p in zip(self._update_buf, self.params, strict=True)
            ):  # the model was converted (`.double()`, `.to()`) after the guard was built
                self._update_buf = None
            if self._update_buf is None:
                self._update_buf = [torch.empty_like(local(p)) for p in self.params]
            with torch.no_grad():
                torch._foreach_copy_(self._update_buf, [local(p.detach()) for p in self.params])
        if not idx:
            return None, idx
        grads = every if len(idx) == len(every) else [every[i] for i in idx]
        return self._norms(grads), idx

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

    def _post_norms(self, second_moments: bool, state: bool) -> tuple[Norms, PostLayout]:
        lay = self._layout if state else self._bare
        state_of = self.optimizer.state
        if lay is None or not lay.fits(self.params, state_of, self.buffers, second_moments):
            lay = PostLayout(self.params, state_of, self.buffers, second_moments,
                             state_too=state)
        norms = lay.norms()
        if norms is None:  # the plan no longer fits (a dtype changed): measured without one
            lay = PostLayout(self.params, state_of, self.buffers, second_moments, plan=False,
                             state_too=state)
            norms = lay.norms()
            assert norms is not None
        if state:
            self._layout = lay
        else:
            self._bare = lay
        return norms, lay

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
            torch._foreach_sub_(self._update_buf, [local(p) for p in self.params])
            upd = self._norms(self._update_buf, like=self.params)
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
        stats._signals = None
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
        stats._signals = None
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
        stats._signals = None
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
