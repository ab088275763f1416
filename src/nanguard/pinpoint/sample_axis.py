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

from collections.abc import Callable, Iterator
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


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` (call arguments: tensors in tuples, lists, dicts) with `fn` applied to each
    tensor; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    return obj


def columns(obj: Any, n: int, i: int) -> Any:
    """`obj` (arguments of a sequence-first step, `n` sequences) with each tensor whose dim 1
    is `n` sliced to column `i` (`(time, batch, ...)` inputs, `(layers, batch, hidden)`
    states), and each 1-D one of `k * n` entries (targets flattened time-major,
    `targets.view(-1)`: entry `t * n + i` is column `i`'s) to that column's `k`."""

    def column(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[1] == n:
            return t[:, i:i + 1]
        if t.dim() == 1 and t.shape[0] == n:  # one target per sequence
            return t[i:i + 1]
        if t.dim() == 1 and t.shape[0] % n == 0:
            return t.view(-1, n)[:, i]
        return t

    return map_tensors(obj, column)
