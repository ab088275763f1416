"""The Guard's in-process replay: the failing step's forward and backward, under the checker.

Runs inside the optimizer's pre-step hook, before the update: the parameters are still those
the step started from. The RNG states go back to the step's start and the same batch is used;
the user's gradients and the RNG states are put back afterwards and the parameters are never
touched (forward and backward only), so observing stays non-invasive. An origin inside
`optimizer.step()` itself is not replayed here (it would need a copy of the parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanguard.pinpoint.replay import find_origin
from nanguard.watch import rng


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
        losses.append(loss.detach())
        loss.backward()

    for p in params:
        p.grad = None
    try:
        if step_rng is not None:
            rng.restore(step_rng)
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
