"""Is dim 0 of the batch its sample axis? Checked while a spike's samples are replayed.

A spike's samples are found by replaying `batch[i:i+1]` (dim 0) one by one
(`pinpoint.inprocess.spike_sources`). A sequence-first model takes `(time, batch)`: an
`nn.LSTM` or `nn.MultiheadAttention` with `batch_first=False` (their default, and
`nn.Transformer`'s), as pytorch/examples' word_language_model feeds them. There dim 0 is time:
each "sample" replayed is one time step of every sequence, and the rows named would be time
steps, not the batch's sequences. While the one-sample replays run, forward pre-hooks on those
modules read their input's batch axis (dim 1 of a 3-D input): more than one sequence there,
from a one-sample slice, means the slice did not cut the batch, and the samples are dropped
with a note rather than named wrongly. A batch-first model that transposes inside (its slice
reaches the module as `(time, 1, features)`) keeps its samples. Only on a spike's replay; a
quiet step pays nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

NOT_SAMPLES = ("samples not named: dim 0 of the batch is not its sample axis (a sequence-first "
               "module, batch_first=False, saw {n} sequences in one sample's replay: the rows "
               "would be time steps)")


def sequence_first(model: nn.Module) -> list[nn.Module]:
    """The model's recurrent and attention modules that take `(time, batch, features)`."""
    return [m for m in model.modules() if isinstance(m, (nn.RNNBase, nn.MultiheadAttention))
            and not getattr(m, "batch_first", True)]


@contextmanager
def watch_sample_axis(model: nn.Module) -> Iterator[list[int]]:
    """While the one-sample replays run inside: the yielded list gains the width of each
    sequence-first module's batch axis it saw (empty: none, or none reached)."""
    widths: list[int] = []

    def seen(_module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and x.dim() == 3:  # (2-D: an unbatched input)
            widths.append(int(x.shape[1]))

    handles = [m.register_forward_pre_hook(seen) for m in sequence_first(model)]
    try:
        yield widths
    finally:
        for h in handles:
            h.remove()


def drop_if_not_samples(found: dict[str, Any], widths: list[int]) -> None:
    """Drop `found`'s samples (and loss samples) when a one-sample replay carried several
    sequences on a module's batch axis (`watch_sample_axis`), with the note why."""
    n = max(widths, default=1)
    if n > 1 and (found.get("samples") or found.get("loss_samples") is not None):
        found["samples"] = []
        found.pop("loss_samples", None)
        found["error"] = NOT_SAMPLES.format(n=n)


def columns(obj: Any, n: int, i: int) -> Any:
    """`obj` (arguments of a sequence-first step, `n` sequences) with each tensor whose dim 1
    is `n` sliced to column `i` (`(time, batch, ...)` inputs, `(layers, batch, hidden)`
    states), and each 1-D one of `k * n` entries (targets flattened time-major,
    `targets.view(-1)`: entry `t * n + i` is column `i`'s) to that column's `k`."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 2 and obj.shape[1] == n:
            return obj[:, i:i + 1]
        if obj.dim() == 1 and obj.shape[0] == n:  # one target per sequence
            return obj[i:i + 1]
        if obj.dim() == 1 and obj.shape[0] % n == 0:
            return obj.view(-1, n)[:, i]
        return obj
    if isinstance(obj, tuple):
        return tuple(columns(v, n, i) for v in obj)
    if isinstance(obj, list):
        return [columns(v, n, i) for v in obj]
    if isinstance(obj, dict):
        return {k: columns(v, n, i) for k, v in obj.items()}
    return obj
