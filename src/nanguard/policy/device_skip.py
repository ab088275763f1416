"""`skip` decided on the device: a fused optimizer's `found_inf` flag, no host read.

Fused Adam, AdamW and SGD (`fused=True`) take a `found_inf` tensor (the GradScaler's way of
skipping a step): when it holds 1 the kernel leaves parameters, optimizer state and the step
counter as they were. Under `skip` acting on non-finite values only (`act_on=("nonfinite",)`),
the guard computes that flag on the device from the step's loss and gradient norms (a NaN or
an infinite norm: a float32 norm that overflows counts, an update that large is no update to
keep) and hands it to the optimizer: `optimizer.step()` never waits for the host. The host
reads the flag with the rest of the step's packet (on a GPU one step later) and records the
`skip` action then; escalation after `RecoverConfig.max_consecutive_skips` comes at that read.

Not used with a GradScaler (it sets `found_inf` itself), under torch.distributed (ranks agree
on the host), with `clip=` or a `replay=` still pinpointing (both need the host before the
update), or with alarms in `act_on` (detectors run on the host).
"""

from __future__ import annotations

import torch

from nanguard.config import GuardConfig
from nanguard.runtime import distributed
from nanguard.watch.norms import Norms

_FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def supports(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` skips on its own `found_inf` flag (a fused Adam / AdamW / SGD)."""
    return isinstance(optimizer, _FUSED) and bool(optimizer.defaults.get("fused"))


def applies(cfg: GuardConfig, optimizer: torch.optim.Optimizer, grads: Norms | None, *,
            scaler_watched: bool) -> bool:
    """Whether this step's `skip` can be decided on the device (see the module docstring);
    `scaler_watched`: a GradScaler is watched (its own skip comes first)."""
    return (cfg.policy == "skip" and set(cfg.acting_on) == {"nonfinite"} and grads is not None
            and not scaler_watched and not distributed.active() and supports(optimizer))


def arm(optimizer: torch.optim.Optimizer, loss: torch.Tensor | None, grads: Norms
        ) -> torch.Tensor:
    """Set the optimizer's `found_inf` from the step's loss and gradient norms (device ops
    only) and return it, for the packet."""
    if not isinstance(grads, torch.Tensor):  # `_foreach_norm`'s 0-dim norms
        grads = torch.stack(list(grads))
    checked = grads if loss is None else torch.cat([loss.reshape(-1).to(grads), grads])
    # 0-dim float32, as the GradScaler hands it (the step counters subtract it).
    found = torch.logical_not(torch.isfinite(checked).all()).to(torch.float32)
    optimizer.found_inf = found  # type: ignore[attr-defined]
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    return found


def disarm(optimizer: torch.optim.Optimizer) -> None:
    """Remove the flag after the step: a later step without it must not be skipped."""
    for name in ("found_inf", "grad_scale"):
        if name in optimizer.__dict__:
            delattr(optimizer, name)
