"""Turn a torch Dataset or DataLoader into a `Table` of rows for the scanner."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from nanguard.audit.common import AuditInputError
from nanguard.audit.scan_readers import Chunk, Table


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix, obj


def _block(items: Any, batched: bool) -> tuple[list[str], np.ndarray]:
    """Column names and a (rows, columns) float64 array for one batch.

    `items` is a batch from a DataLoader (`batched`) or a list of samples.
    """
    import torch

    names: list[str] = []
    parts: list[np.ndarray] = []
    first = items if batched else items[0]
    for path, leaf in _leaves(first, ""):
        if isinstance(leaf, (str, bytes)) or leaf is None:
            continue  # text and missing fields are not numeric features
        if batched:
            arr = leaf
        else:
            arr = [dict(_leaves(sample, "")).get(path) for sample in items]
            if isinstance(leaf, torch.Tensor):
                try:
                    arr = torch.stack(arr)
                except (RuntimeError, TypeError):
                    raise AuditInputError(
                        f"dataset field {path or 'sample'!r} changes shape between samples; "
                        "scan_dataset needs fixed-size samples"
                    ) from None
        if isinstance(arr, torch.Tensor):
            if arr.is_complex():
                continue
            block = arr.detach().cpu().to(torch.float64).numpy()
        else:
            try:
                block = np.asarray(arr, dtype=np.float64)
            except (TypeError, ValueError):
                continue  # non-numeric field
        rows = block.shape[0] if block.ndim else 1
        block = block.reshape(rows, -1)
        label = path or "0"
        width = block.shape[1]
        single = isinstance(leaf, (int, float)) or getattr(leaf, "ndim", 1) == (1 if batched else 0)
        names += [label] if single and width == 1 else [f"{label}[{j}]" for j in range(width)]
        parts.append(block)
    if not parts:
        raise AuditInputError("dataset samples hold no numeric fields")
    return names, np.concatenate(parts, axis=1)


def dataset_table(dataset: Any, batch_size: int, name: str) -> Table:
    """A Table over a map-style / iterable Dataset, or a DataLoader (one chunk per batch)."""
    from torch.utils.data import DataLoader

    if batch_size < 1:
        raise AuditInputError(f"batch_size must be >= 1, got {batch_size}")
    batched = isinstance(dataset, DataLoader)
    if not batched and not isinstance(dataset, Iterable) and not hasattr(dataset, "__getitem__"):
        raise AuditInputError(f"cannot iterate over a {type(dataset).__name__}")
    try:  # progress in samples (Dataset) or batches (DataLoader); unknown for iterables
        total: float | None = float(len(dataset))
    except TypeError:
        total = None

    def groups() -> Iterator[Any]:
        if batched:
            yield from dataset
            return
        if hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
            samples: Iterator[Any] = (dataset[i] for i in range(len(dataset)))
        else:
            samples = iter(dataset)
        while block := list(itertools.islice(samples, batch_size)):
            yield block

    first_names: list[str] = []
    state = {"pos": 0.0}

    def chunks() -> Iterator[Chunk]:
        start = 0
        for items in groups():
            names, values = _block(items, batched)
            if not first_names:
                first_names.extend(names)
            elif names != first_names:
                raise AuditInputError(
                    f"samples near row {start} have different fields or shapes than the first"
                )
            yield Chunk(start=start, values=values)
            start += values.shape[0]
            state["pos"] = state["pos"] + 1 if batched else float(start)

    # Column names are only known after the first batch: peek at it, then replay it.
    iterator = chunks()
    try:
        head = next(iterator)
    except StopIteration:
        raise AuditInputError(f"{name}: empty dataset") from None

    def replay() -> Iterator[Chunk]:
        yield head
        yield from iterator

    return Table(
        name=name,
        columns=list(first_names),
        chunks=replay,
        position=lambda: state["pos"],
        total=total,
    )
