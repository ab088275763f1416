"""The Guard's replays of one step, before its update: micro-batch by micro-batch, and the
per-layer / per-sample sources of a spike. Activation watching is paused meanwhile: the
replayed forwards are not the step's activations."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nanguard.watch.activations import ActivationProbe
from nanguard.watch.batch import batch_tensors


@contextlib.contextmanager
def activations_paused(probe: ActivationProbe | None) -> Iterator[None]:
    """Switch activation watching off for the block, back to what it was after it."""
    was = probe.enabled if probe else False
    if probe:
        probe.enabled = False
    try:
        yield
    finally:
        if probe:
            probe.enabled = was


def replay_batches(
    replay: Callable[[Any], torch.Tensor], *, model: torch.nn.Module,
    params: list[torch.Tensor], batches: list[Any], step: int, loss: float | None,
    step_rng: dict[str, Any] | None, act_probe: ActivationProbe | None,
) -> dict[str, Any] | None:
    """Replay the step's micro-batches one by one (forward and backward, under the op
    checker) until one produces a non-finite value; its origin, with `samples` numbered across
    the micro-batches as the guard numbers them. The RNG states go back to `step_rng` for the
    first micro-batch. Raises what the replay raised."""
    from nanguard.pinpoint.inprocess import replay_forward_backward

    offset = 0
    with activations_paused(act_probe):
        for k, batch in enumerate(batches):
            found = replay_forward_backward(
                replay, model=model, params=params, batch=batch, step=step,
                step_rng=step_rng if k == 0 else None,
                original_loss=loss if len(batches) == 1 else None,
            )
            if found is not None:
                found["samples"] = [offset + i for i in found.get("samples") or []]
                if len(batches) > 1:
                    found["micro_batch"] = k
                # null: the step's losses were not comparable (one loss is kept per step, not
                # one per micro-batch)
                found.setdefault("reproduced", None)
                return found
            sized = [t for t in batch_tensors(batch) if t.dim() > 0]
            offset += sized[0].shape[0] if sized else 0
    return None


def carried_by(found: dict[str, Any]) -> str:
    """`; carried by layers ... ; samples ...` for a spike alarm's message ('' when neither
    is known)."""
    parts = []
    if found["layers"]:
        parts.append("layers " + ", ".join(f"{d['param']} ({d['ratio']:.3g}x)"
                                           for d in found["layers"][:3]))
    if found["samples"]:
        parts.append("samples " + ", ".join(str(d["index"]) for d in found["samples"][:5]))
    return "; carried by " + "; ".join(parts) if parts else ""
