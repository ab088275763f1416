"""The host-side statistics of one optimizer step (`StepStats`), as the watch decodes them.

The probes (`watch.probe`, `watch.batch`) measure on the device; the step's one host read is
decoded into a `StepStats` (by `watch.step` or the quiet lane, `watch.lane`), which the
detectors, the policy and the record then read. Norms are kept as read: NaN / inf included.
`seal` computes what every quiet step asks for once (the non-finite signals, the global norms).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, overload

from nanguard.record.writer import RawHashes, combine_sums
from nanguard.watch.layout import FIRST_MOMENT_KEYS, SECOND_MOMENT_KEYS


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
            return ()
        d = obj.__dict__
        v = d.get("_hashes")
        if v is None:  # none set: an empty list, kept (appending to it sticks)
            v = d["_hashes"] = []
        elif type(v) is tuple:
            v = d["_hashes"] = combine_sums(v)
        return v

    def __set__(self, obj: StepStats, value: list[int] | tuple[int, ...]) -> None:
        obj.__dict__["_hashes"] = list(value)


_HASHES = _Hashes()
"""`StepStats.sample_hashes`, a field with `init=False`: the generated `__init__` assigns it
nothing (no descriptor call per step); an instance holds none until one is set or read."""


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
    sample_hashes: _Hashes = field(default=_HASHES, init=False)
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
    clip_norm: float | None = None
    """The gradients' total norm as the script's own `clip_grad_norm_` measured it this step,
    before clipping (`Guard.note_clip_norm`), read with the step; None where it did not clip.
    What the grad-norm detectors judge (`judged_grad_norm`)."""
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
    sealed_norms: tuple[float, float, float | None] | None = field(
        default=None, repr=False, compare=False)
    """`global_norms()` as the last `seal()` computed them; None until a step is sealed and
    again once `unseal` (or `assume_overflow`) changed its values. The quiet gate and the
    record read it after the detectors' `seal`: an attribute, not a call, on every step."""

    def defer_hashes(self, raw: RawHashes) -> None:
        """Keep the batch's per-tensor sums as read; `sample_hashes` combines them when read."""
        self.__dict__["_hashes"] = raw

    def raw_hashes(self) -> RawHashes | list[int]:
        """The fingerprints as they are kept: still-raw sums (`defer_hashes`), or the list."""
        v: RawHashes | list[int] = self.__dict__.get("_hashes", [])
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
            gn = math.sqrt(sum(map(operator.mul, gv, gv))) if g else 0.0
            pn = math.sqrt(sum(map(operator.mul, pv, pv))) if p else 0.0
            self._derived = {"grad_norm": gn, "param_norm": pn, "momentum_norm": m}
            self.sealed_norms = (gn, pn, m)
            # The quiet step: nothing dropped, a finite loss, no bad gradient, and finite sums
            # of the norms (>= 0: finite exactly when each is), checked here without
            # `nonfinite_signals`'s call; anything else is scanned by it.
            loss = self.loss
            if (not self.dropped_samples and not self.nonfinite_grads
                    and (loss is None or math.isfinite(loss))
                    and math.isfinite(sum(pv) + sum(self.buffer_norms.values())
                                      + sum(self.activations.values()))
                    and (not self.state_norms or math.isfinite(
                        sum(map(sum, map(dict.values, self.state_norms.values())))))):
                self._signals = []
            else:
                self._signals = self.nonfinite_signals()
        return self._signals

    def global_norms(self) -> tuple[float, float, float | None]:
        """(`grad_norm`, `param_norm`, `momentum_norm`) in one call: what the quiet gate and
        the record both ask for (kept by `seal`)."""
        if self._signals is not None and self.sealed_norms is not None:
            return self.sealed_norms
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
    def judged_grad_norm(self) -> float:
        """The global grad norm the detectors judge: the script's own clip's measured total
        where it clipped this step (`clip_norm`), else `grad_norm`. A clip bounds the update,
        not the backward pass: a bad batch's spike, or a growing gradient, shows in the norm
        before clipping; after it every step of a clipped run can read `max_norm`."""
        c = self.clip_norm
        return self.grad_norm if c is None else c

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
        `loss`, `grad_norm` (global, before the script's own clip where it clipped, as the
        detectors judge it; None when no gradient was measured), `act_max` (largest
        finite activation abs-max), `lr` and `update_ratio` (None on steps not sampled). Plain
        floats, NaN/Inf kept."""
        acts = [v for v in self.activations.values() if math.isfinite(v)]
        return {"step": self.step, "loss": self.loss,
                "grad_norm": self.judged_grad_norm if self.grad_norms else None,
                "act_max": max(acts) if acts else None, "lr": self.lr,
                "update_ratio": self.update_ratio}

    def assume_overflow(self) -> None:
        """Call infinite (not NaN) norms overflows of finite values. Sound when the parameters
        are known finite after this step: a non-finite gradient, parameter or state value
        would have made them non-finite for good (NaN and inf are absorbing in SGD / Adam
        updates), so an infinite norm here can only be a float32 sum of squares overflowing."""
        self._signals = self.sealed_norms = None
        for i in [i for i in self.nonfinite_grads if math.isinf(self.grad_norms[i])]:
            self.nonfinite_grads.discard(i)
            self.overflowed.add(i)
        for key, norms in [("param", self.param_norms), *self.state_norms.items()]:
            self.overflow_norms |= {(key, i) for i, v in norms.items() if math.isinf(v)}

    def unseal(self) -> None:
        """Forget what `seal` kept. Called by whoever changes a sealed step's values from
        outside this module (the state norms decoded late, a buffer set aside, activations
        of a skipped forward dropped); the next `seal` scans again."""
        self._signals = self.sealed_norms = None

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
