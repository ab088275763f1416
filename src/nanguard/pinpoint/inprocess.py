"""The Guard's in-process replay: the failing step's forward and backward, under the checker.

Runs inside the optimizer's pre-step hook, before the update: the parameters are still those
the step started from. The RNG states go back to the step's start and the same batch is used;
the user's gradients and the RNG states are put back afterwards and the parameters are never
touched (forward and backward only), so observing stays non-invasive. An origin inside
`optimizer.step()` itself is not replayed here (it would need a copy of the parameters).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanguard.pinpoint.replay import find_origin
from nanguard.pinpoint.sample_axis import columns
from nanguard.watch import rng

_BACKPROPAGATED: dict[str, Any] = {"ref": None, "comparable": True}
"""A weak reference to the loss a replay function returned after running its own backward
(an `optimizer.step(closure)` closure does forward, loss and backward itself), and whether it
is the step's loss (compared with the original for `reproduced`)."""


def mark_backpropagated(loss: torch.Tensor, *, comparable: bool = True) -> None:
    """The replay function already ran `loss.backward()` (a closure), or has no loss to run it
    on (`comparable=False`: a forward replayed alone returns the model's output, which is not
    the step's loss and is not compared with it): the replay must not."""
    import weakref

    _BACKPROPAGATED.update(ref=weakref.ref(loss), comparable=comparable)


_COMPARED: dict[str, Any] = {"ref": None, "value": None}
"""The value to compare for `reproduced` in place of the loss a replay function returned
(`compare_as`), with a weak reference to that loss."""


def compare_as(loss: torch.Tensor, value: torch.Tensor) -> None:
    """Compare `value` with the step's recorded loss for `reproduced`, not `loss` itself: the
    replay returns the loss as it was backpropagated (scaled: `loss / accum_steps`), while the
    guard recorded it in the script's units."""
    import weakref

    _COMPARED.update(ref=weakref.ref(loss), value=value)


def _compared(loss: torch.Tensor) -> torch.Tensor:
    ref, value = _COMPARED["ref"], _COMPARED["value"]
    _COMPARED.update(ref=None, value=None)
    return value if ref is not None and ref() is loss else loss.detach()


def _backpropagated(loss: torch.Tensor) -> bool:
    ref = _BACKPROPAGATED["ref"]
    return ref is not None and ref() is loss


class KeepBuffers:
    """Put the model's buffers back after a replay: a train-mode forward updates BatchNorm
    running statistics and counters, and observing must not change training."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        with torch.no_grad():
            self.saved = [b.detach().clone() for b in model.buffers()]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for b, s in zip(self.model.buffers(), self.saved, strict=True):
                b.copy_(s)


def _eager() -> contextlib.AbstractContextManager[Any]:
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance is not None else contextlib.nullcontext()


@contextlib.contextmanager
def local(model: nn.Module) -> Any:
    """A replay's forward and backward without DDP's collectives (nothing for other models).
    A replay may run on one rank alone (its loss went non-finite, the others' did not), or on
    two ranks of many (`pinpoint.xrank`): a collective in it would pair with another rank's
    next training collective, mixing the replay into that rank's update, or hang. So the
    gradient all-reduce is off (`no_sync`) and so is the broadcast of buffers before the
    forward (`require_forward_param_sync`), which DDP's forward under `no_sync` would also
    clear for the next training forward: its value is put back, so that next forward syncs
    the buffers exactly as it would have without the replay."""
    no_sync = getattr(model, "no_sync", None)
    if not callable(no_sync):
        yield
        return
    synced = getattr(model, "require_forward_param_sync", None)
    try:
        if synced is not None:
            setattr(model, "require_forward_param_sync", False)  # noqa: B010 - DDP's flag
        with no_sync():
            yield
    finally:
        if synced is not None:
            setattr(model, "require_forward_param_sync", synced)  # noqa: B010


def replay_forward_backward(
    compute_loss: Callable[[Any], torch.Tensor],
    *,
    model: nn.Module,
    params: list[torch.Tensor],
    batch: Any,
    step: int,
    step_rng: dict[str, Any] | None,
    original_loss: float | None,
) -> dict[str, Any] | None:
    """Replay and return the origin as a `first_nonfinite` dict (with `reproduced`), or None.

    Raises whatever the replay raised; the caller decides how to record it.
    """
    grads = [p.grad for p in params]
    now = rng.capture()
    losses: list[torch.Tensor] = []

    def run_step() -> None:
        loss = compute_loss(batch)
        if not _backpropagated(loss):
            losses.append(_compared(loss))
            loss.backward()
            return
        # A closure (its backward ran inside it, checked too), or a forward replayed alone.
        if _BACKPROPAGATED["comparable"]:
            losses.append(loss.detach())
        _BACKPROPAGATED["ref"] = None

    for p in params:
        p.grad = None
    try:
        if step_rng is not None:
            rng.restore(step_rng)
        # A compiled model runs eagerly under the checker: compiling it under a dispatch mode
        # left later compiled runs 1 ulp off (observing must not change training).
        with KeepBuffers(model), _eager(), local(model):
            origin = find_origin(run_step, model=model, batch=batch, step=step)
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        rng.restore(now)
    if origin is None:
        return None
    found = origin.to_dict()
    if losses and original_loss is not None:
        # Bit for bit: the replayed loss must equal the original (NaN counts as equal).
        a, b = float(losses[0].reshape(-1)[0]), original_loss
        found["reproduced"] = (math.isnan(a) and math.isnan(b)) or a == b
    return found


def _slice(batch: Any, i: int, width: int = 0) -> Any:
    """Sample `i` of a batch (tensor, or tuple / list / dict of them), keeping a batch dim.
    `width` > 0: a sequence-first batch of `width` sequences, its column `i`
    (`sample_axis.columns`, as a recorded step's is sliced)."""
    if width:
        return columns(batch, width, i)
    if isinstance(batch, torch.Tensor):
        return batch[i : i + 1] if batch.dim() > 0 else batch
    if isinstance(batch, dict):
        return {k: _slice(v, i) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, i) for v in batch)
    return batch


def spike_sources(
    compute_loss: Callable[[Any], torch.Tensor],
    *,
    model: nn.Module,
    params: list[torch.Tensor],
    param_names: list[str],
    batch: Any,
    grad_norms: dict[int, float],
    baseline: dict[int, float],
    batch_size: int,
    step_rng: dict[str, Any] | None,
    layer_ratio: float = 10.0,
    sample_z: float = 3.5,
    max_samples: int = 64,
    loss_level: float | None = None,
    batch_loss: float | None = None,
    width: int = 0,
) -> dict[str, Any]:
    """A spike without a NaN, before its update: the layers whose gradient norm is far above
    their own healthy level, the samples whose per-sample gradient norm is an outlier and
    (`loss_samples`, every one) those whose own loss is.

    Layers come from the step's measured per-parameter norms (no extra work). Samples cost one
    forward and backward per sample (at most `max_samples`), only on a spike alarm; gradients
    are taken with `torch.autograd.grad`, so `.grad` and the parameters stay untouched.

    `loss_level`: the loss's level before the spike (the guard's recent loss), in the units of
    a sample's own loss; the rows' losses are judged against it (`norm_outliers`), so a batch
    with half its rows corrupted still has each named. None: against the batch's own median,
    as also when the rows' mean loss is not the step's loss `batch_loss` within a third (a
    summed loss: a row's loss is not in the level's units).

    `width` > 0: the batch is sequence-first (`pinpoint.sample_axis`), its samples the
    `width` columns of dim 1 (`batch_size` is then `width`).
    """
    from nanguard.pinpoint.spike import norm_outliers

    layers: list[dict[str, Any]] = []
    for i, v in grad_norms.items():
        base = baseline.get(i)
        if base and base > 0 and v / base >= layer_ratio:
            layers.append({"param": param_names[i], "module": param_names[i].rpartition(".")[0],
                           "norm": v, "baseline": base, "ratio": v / base})
    layers.sort(key=lambda d: -float(d["ratio"]))
    norms: list[float] = []
    losses: list[float] = []  # each sample's own loss (a bad batch's rows stand out in it)
    trainable = [p for p in params if p.requires_grad]
    now = rng.capture()
    keep = KeepBuffers(model) if batch_size else None
    error = None
    try:
        with local(model):
            for i in range(min(batch_size, max_samples)):
                if step_rng is not None:
                    rng.restore(step_rng)
                loss = compute_loss(_slice(batch, i, width))
                losses.append(float(loss.detach()))
                grads = torch.autograd.grad(loss, trainable, allow_unused=True)
                sq = sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None)
                norms.append(math.sqrt(sq))
    except Exception as exc:  # noqa: BLE001 - e.g. BatchNorm cannot run one sample in train mode
        norms, losses = [], []
        error = f"per-sample gradients failed: {type(exc).__name__}: {exc}"
    finally:
        if keep is not None:
            keep.__exit__()
        rng.restore(now)
    found: dict[str, Any] = {"layers": layers[:8], "samples": norm_outliers(norms, sample_z)[:8]}
    if len(losses) == len(norms) and losses and min(losses) > 0:
        level = loss_level
        if batch_loss is not None and not 0.75 <= sum(losses) / len(losses) / batch_loss <= 1.33:
            level = None  # rows in other units than the step's loss: no common level
        found["loss_samples"] = [{"index": d["index"], "loss": d["norm"], "z": d["z"]}
                                 for d in norm_outliers(losses, sample_z, level)]
    if error:
        found["error"] = error
    return found
