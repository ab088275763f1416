"""What computing a recorded step's loss again takes, and how (`nanguard run`'s in-process
replay; the recording itself is pinpoint/recorded.py).

A `Recipe` is one `backward()`'s worth of a step: the model call(s) it needs (`RootCall`: the
module, its arguments by reference with their version counters, the RNG and autocast states it
started with) and the loss (`LossCall`: a `torch.nn.functional` loss of a call's output, how
the loss input came from that output, its other arguments), or an expression over several
losses (pinpoint/loss_expr.py), or the element of the output that is the loss, or, for a loss
of the script's own arithmetic, the forward alone (`forward_only`). `MicroRecipes` holds the
recipes of a step of gradient accumulation, one per micro-batch. `Recipe.run()` is what the
guard's `replay` calls, before the update, under the op checker; `run(sample)` computes one
sample's loss (a spike's per-sample gradients). A recipe whose inputs changed in place since
raises `NotReplayable` with a one-line reason.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from nanguard.audit.preflight_live import select_path, tensor_versions
from nanguard.pinpoint import loss_expr
from nanguard.pinpoint.attribution import replayed_at
from nanguard.pinpoint.sample_axis import columns, map_tensors
from nanguard.watch import rng

MAX_CALLS = 8
"""Root calls and loss calls kept per step; more than that is not a simple step anyway."""
_AMP_DEVICES = ("cpu", "cuda")


class NotReplayable(Exception):  # noqa: N818 - the word users read in `replay.in_process`
    """This step cannot be replayed in process; the message says why in one line."""


_ANY_AMP = getattr(torch._C, "_is_any_autocast_enabled", None)


def amp_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast devices on and their dtypes (one C call when none is: the usual case)."""
    if _ANY_AMP is not None and not _ANY_AMP():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AMP_DEVICES
                 if torch.is_autocast_enabled(d))


@contextlib.contextmanager
def autocast_as(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Autocast as it was when the call was recorded (off for the devices it was off for)."""
    with contextlib.ExitStack() as stack:
        for d in _AMP_DEVICES:
            dtype = dict(state).get(d)
            stack.enter_context(torch.autocast(d, dtype=dtype, enabled=dtype is not None))
        yield


def flat_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, int]]:
    """`tensor_versions(args, kwargs)`, without its recursion for the usual flat call (on the hot
    path: once per root call)."""
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append((v, v._version))
        elif isinstance(v, (tuple, list, dict)):
            out += tensor_versions(v)
    return out


def weak_tree(obj: Any, depth: int = 0) -> Any:
    """`obj` (a module's output) with weak references in place of its tensors, to the depth
    `_find` looks (tuples and lists become tuples, mappings dicts: the same paths select)."""
    if isinstance(obj, torch.Tensor):
        return weakref.ref(obj)
    if depth >= 2:
        return None
    if isinstance(obj, (tuple, list)):
        return tuple(weak_tree(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return {k: weak_tree(v, depth + 1) for k, v in obj.items()}
    return None


def live_tree(obj: Any) -> Any:
    """The tensors of a `weak_tree` structure that are still alive (None for the others)."""
    if isinstance(obj, weakref.ref):
        return obj()
    if isinstance(obj, tuple):
        return tuple(live_tree(v) for v in obj)
    if isinstance(obj, dict):
        return {k: live_tree(v) for k, v in obj.items()}
    return None


def _batch_of(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
              ) -> tuple[torch.Tensor, ...]:
    """The tensors `Discovery` hands the guard as the batch of a root call: its positional
    tensors, or for a call by keywords only (`model(input_ids=..., labels=...)`) its keyword
    tensors, in their order (the guard is handed them as a dict)."""
    tensors = tuple(a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0)
    if tensors or not kwargs:
        return tensors
    return tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _given(batch: Any) -> tuple[Any, ...]:
    """The tensors of a batch as the guard was handed it (a tensor, a tuple / list, a dict)."""
    if batch is None:
        return ()
    if isinstance(batch, dict):
        return tuple(batch.values())
    return tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)


@dataclass(eq=False)
class RootCall:
    """One grad-enabled call of a root module."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]
    rng: dict[str, Any]
    amp: tuple[tuple[str, torch.dtype], ...]
    output: Any = None
    """The output as weak references (`weak_tree`), until the step's backward: the loss input is
    looked up in it."""
    source: str | None = None
    """The user's line that made the call (`attribution.user_source`): a replayed op of the
    call ran there."""


@dataclass(eq=False)
class LossCall:
    """One `torch.nn.functional` loss whose input came from a root call's output, or (`fn`
    None) a scalar element of the output itself: the loss a model computes and returns
    (`model(**batch).loss`)."""

    fn: Any
    call: RootCall
    path: tuple[Any, ...]
    shape: tuple[int, ...] | None
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]
    amp: tuple[tuple[str, torch.dtype], ...]
    result: weakref.ref[torch.Tensor] | None = None
    """The loss value, weakly, until the step's backward (compared by identity)."""
    source: str | None = None
    """The user's line that called the loss (the model's call for a loss it returns)."""


@dataclass(eq=False)
class Recipe:
    """How to compute one recorded step's loss again: call the module, take the loss."""

    call: RootCall
    loss: LossCall | None
    path: tuple[Any, ...] = ()
    """Without `loss`: where the loss sits in the output (a model that returns its loss)."""
    forward_only: str | None = None
    """The loss is the script's own arithmetic (not recognised): only the forward is replayed,
    and only an origin whose value reached the model's output counts; this says why."""
    expr: Any = None
    """The loss backpropagated as an expression over recorded losses (`loss_expr`), when it
    is not `loss` itself: one times or divided by a constant, a sum of several."""
    calls: tuple[RootCall, ...] = ()
    """The model calls `expr` needs, in the script's order, when there are several (a
    discriminator called on real and on fake data); empty: `call` alone."""

    def _losses(self) -> list[LossCall]:
        if self.expr is not None:
            return cast(list[LossCall], loss_expr.leaves(self.expr))
        return [self.loss] if self.loss is not None else []

    def matches(self, batch: Any) -> bool:
        """`batch` is the one the guard was handed for this step (the same tensors as one of
        the calls' arguments)."""
        theirs = _given(batch)
        for call in self.calls or (self.call,):
            mine = _batch_of(call.args, call.kwargs)
            if len(theirs) == len(mine) and all(a is b for a, b in zip(theirs, mine,
                                                                        strict=True)):
                return True
        return False

    def sample_of(self, batch: Any) -> tuple[int, int] | None:
        """`batch` is one sample of this step's batch (`batch[i:i+1]` of each of its tensors,
        as the guard slices it to find a spike's samples; `batch[:, i:i+1]` of a
        sequence-first one, `pinpoint.sample_axis`): `(i, axis)`, else None (also for a step
        of several model calls)."""
        mine = _batch_of(self.call.args, self.call.kwargs)
        theirs = _given(batch)
        if self.calls or not mine or len(theirs) != len(mine):
            return None
        found = None
        for t, r in zip(theirs, mine, strict=True):
            at = _row_of(t, r)
            if at is None or (found is not None and at != found):
                return None
            found = at
        return found

    def run(self, sample: int | None = None, axis: int = 0) -> torch.Tensor:
        """The step's forwards and loss again, each forward from the RNG states it started
        with; with `sample`, of that sample of the batch alone (the batch's tensors and the
        loss's per-sample arguments sliced to it; `axis` 1: a sequence-first batch, its
        sample `sample` the column of each tensor whose dim 1 is the batch's, and of each
        target flattened time-major, `targets.view(-1)`).

        Raises:
            NotReplayable: a tensor of the batch or the targets changed in place since, or
                torch.distributed is initialized, or a sample's loss of a forward replayed
                alone is asked for.
        """
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Asked here, not at every step boundary: only a replay needs to know.
            raise NotReplayable("torch.distributed: a replayed backward would wait for the "
                                "other ranks")
        losses = self._losses()
        calls = self.calls or (self.call,)
        versions = [v for c in calls for v in c.versions] + [v for x in losses for v in x.versions]
        if any(t._version != v for t, v in versions):
            raise NotReplayable("the script changed the batch in place after the forward")
        if sample is not None and (self.forward_only is not None or not losses):
            raise NotReplayable("no per-sample loss: the loss is not a recognised one of the "
                                "model's output")
        n = (_batch_of(self.call.args, self.call.kwargs)[0].shape[axis]
             if sample is not None else 0)
        cut = _rows if axis == 0 else columns
        outputs: dict[int, Any] = {}
        for call in calls:
            rng.restore(call.rng)
            args, kwargs = call.args, call.kwargs
            if sample is not None:
                args, kwargs = cut(args, n, sample), cut(kwargs, n, sample)
            # Its ops ran at the script's line of this call, not in this frame.
            with autocast_as(call.amp), replayed_at(call.source):
                outputs[id(call)] = call.module(*args, **kwargs)
        out = outputs[id(self.call)]
        if self.forward_only is not None:
            return _forward_result(out, self.forward_only)
        if not losses:
            return cast(torch.Tensor, select_path(out, self.path))

        def value_of(loss: LossCall) -> torch.Tensor:
            x = select_path(outputs[id(loss.call)], loss.path)
            if loss.fn is None:  # the model's own loss, an element of its output
                return cast(torch.Tensor, x)
            rest, extra, shape = loss.rest, loss.kwargs, loss.shape
            if sample is not None:
                rest, extra = cut(rest, n, sample), cut(extra, n, sample)
                if shape is not None and shape and shape[0] % n == 0:
                    shape = (shape[0] // n, *shape[1:])  # logits.view(-1, V): a sample's rows
            if shape is not None:
                x = x.reshape(shape)
            with autocast_as(loss.amp), replayed_at(loss.source):
                return cast(torch.Tensor, loss.fn(x, *rest, **extra))

        if self.expr is None:
            return value_of(losses[0])
        return loss_expr.evaluate(self.expr, value_of)


def _row_of(t: Any, r: torch.Tensor) -> tuple[int, int] | None:
    """`t` is `r[i:i+1]` (a view of one row of `r`): `(i, 0)`; `r[:, i:i+1]` (one column of a
    sequence-first batch): `(i, 1)`; else None."""
    if not isinstance(t, torch.Tensor) or t.dim() != r.dim():
        return None
    axis = 0 if t.shape[0] == 1 and t.shape[1:] == r.shape[1:] else 1
    if axis and (r.dim() < 2 or t.shape[1] != 1 or t.shape[0] != r.shape[0]
                 or t.shape[2:] != r.shape[2:]):
        return None
    if r.stride(axis) == 0:
        return None
    try:
        if t.untyped_storage().data_ptr() != r.untyped_storage().data_ptr():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    i, rem = divmod(int(t.storage_offset()) - int(r.storage_offset()), int(r.stride(axis)))
    return (i, axis) if rem == 0 and 0 <= i < r.shape[axis] else None


def _rows(obj: Any, n: int, i: int) -> Any:
    """`obj` (arguments) with each tensor whose leading dimension is the batch's `n` sliced to
    row `i`, and each whose leading dimension is a multiple `k * n` of it (targets flattened
    batch-major, `targets.view(-1)`) to that row's `k` entries; other values as they are."""

    def row(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] % n:
            return t
        k = t.shape[0] // n
        return t[i * k:(i + 1) * k]

    return map_tensors(obj, row)


@dataclass(eq=False)
class MicroRecipes:
    """A step of gradient accumulation: one recipe per `backward()` (micro-batch), in order.
    The guard replays its micro-batches one by one (pinpoint/step_replay.py); each is
    computed again by the recipe whose batch it is."""

    parts: list[Recipe]

    def part(self, batch: Any) -> Recipe | None:
        """The recipe of micro-batch `batch` (or of the micro-batch `batch` is a sample of),
        or None."""
        return next((r for r in self.parts
                     if r.matches(batch) or r.sample_of(batch) is not None), None)

    def matches(self, batch: Any) -> bool:
        return self.part(batch) is not None


def _forward_result(out: Any, why: str) -> torch.Tensor:
    """The model's output of a forward replayed alone, marked so that no backward runs on it.
    Only a non-finite output is taken: then the first non-finite value of the step was made in
    the forward (nothing of the step runs before it) and reached the loss, so the checker's
    origin is exact. A finite output (nothing non-finite, or a value the forward itself cut
    off, such as a -inf that a gather skipped) says nothing of the loss: refused.

    Raises:
        NotReplayable: the replayed forward's output is finite.
    """
    from nanguard.pinpoint.inprocess import mark_backpropagated

    tensors = [t for t in _flat(out) if t.is_floating_point() and t.numel()]
    with torch.no_grad():
        bad = next((t for t in tensors if not bool(torch.isfinite(t).all())), None)
    if bad is None:
        raise NotReplayable(f"{why}; its forward alone, replayed, gives a finite output (the "
                            "value is made in the loss or the backward)")
    mark_backpropagated(bad, comparable=False)
    return bad


def _flat(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth >= 2:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _flat(v, depth + 1)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat(v, depth + 1)]
    return []


