"""Buffers that training does not read: a non-finite one is a warning, not the failure.

BatchNorm's running mean and variance are written by every training-mode forward but read
only in eval mode: a running variance that overflows (a batch variance near float32's limit
times n / (n - 1)) leaves training finite, and the first failure comes later, or in the
evaluation. Taking it for the first failure would name a step where nothing the training
reads went non-finite. `note(model)` (when the guard picks its watched buffers) remembers
which buffers are such statistics and of which module; `set_aside(stats, buffers)` (only on a
step whose post-update norms came back non-finite) moves those of a module in training mode
into `StepStats.unread_nonfinite`, which `nonfinite_signals` leaves out and the post-update
non-finite detector reports once as a `buffer_nonfinite` warning.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

_STATS = ("running_mean", "running_var")
_known: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[nn.Module], str]] = {}
"""id(buffer) -> (the buffer, its module, its name in the model), all weakly."""


def note(model: nn.Module) -> None:
    """Remember the running statistics of `model`'s BatchNorm layers (no device read)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.modules.batchnorm._NormBase):
            continue
        for key in _STATS:
            t = getattr(module, key, None)
            if isinstance(t, torch.Tensor):
                full = f"{name}.{key}" if name else key
                _known[id(t)] = (weakref.ref(t), weakref.ref(module), full)


def set_aside(stats: Any, buffers: list[torch.Tensor]) -> None:
    """Move the non-finite buffers that training does not read (running statistics of a
    BatchNorm in training mode) from the failure signals to `stats.unread_nonfinite` (`stats`
    is a `watch.stats.StepStats`; not imported: stats imports this module)."""
    for i, v in stats.buffer_norms.items():
        if math.isfinite(v) or i >= len(buffers):
            continue
        hit = _known.get(id(buffers[i]))
        if hit is None or hit[0]() is not buffers[i]:
            continue
        module = hit[1]()
        if module is not None and module.training:
            stats.unread_nonfinite[i] = hit[2]
            stats.unseal()


def training_names() -> set[str]:
    """Names of the running statistics whose BatchNorm is in training mode now: at the first
    step they were already written by its forward, so a non-finite one there came from that
    forward, not with loaded state (`StepWatch.decode_pre`)."""
    out = set()
    for ref, module_ref, name in list(_known.values()):
        module = module_ref()
        if ref() is not None and module is not None and module.training:
            out.add(name)
    return out
