"""What the guard learns about the batch it is handed: per-sample fingerprints and NaN rows.

Everything stays on the device until the step's single host read. The batch itself is kept by
reference (no copy) as `last`, for an in-process replay of the step.
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard.watch.fingerprint import sample_fingerprints
from nanguard.watch.stats import StepStats

_MASK = (1 << 52) - 1


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in a batch: a tensor, or a tuple / list / dict of them (nested ok)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in batch_tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in batch_tensors(v)]
    return []


class BatchProbe:
    """Fingerprints and non-finite sample flags of the batch handed to `Guard.watch`."""

    def __init__(self) -> None:
        self.last: Any = None
        self._vec: torch.Tensor | None = None
        self._size = 0

    def observe(self, batch: Any, accumulate: bool = True) -> None:
        """Fingerprint `batch` on the device. With `accumulate`, the NaN flags of earlier
        batches observed since the last `collect` (micro-batches of one step) are kept."""
        tensors = [t for t in batch_tensors(batch) if t.dim() > 0]
        self.last = batch
        if not tensors:
            return
        size = tensors[0].shape[0]
        tensors = [t for t in tensors if t.shape[0] == size]
        with torch.no_grad():
            device = tensors[0].device
            h = torch.zeros(size, dtype=torch.float64, device=device)
            bad = torch.zeros(size, dtype=torch.bool, device=device)
            per_tensor = []  # which tensor holds it: inputs (first) or targets (last)
            for t in tensors:
                f = sample_fingerprints(t).to(device)
                h = _combine(h, f)
                if t.is_floating_point() or t.is_complex():
                    rows = (~torch.isfinite(t.detach())).reshape(size, -1).any(dim=1).to(device)
                    bad |= rows
                    per_tensor.append(rows.any())
                else:
                    per_tensor.append(torch.zeros((), dtype=torch.bool, device=device))
        vec = torch.cat([h, bad.double(), torch.stack(per_tensor).double()])
        if accumulate and self._vec is not None and self._vec.shape == vec.shape:
            # Another micro-batch of the same step (gradient accumulation): keep the last one's
            # fingerprints, but every micro-batch's NaN rows and tensors.
            flags = torch.maximum(self._vec[size:], vec[size:].to(self._vec.device))
            vec = torch.cat([vec[:size], flags.to(vec.device)])
        self._vec = vec
        self._size = size

    def collect(self) -> tuple[int, torch.Tensor | None]:
        """Take what was observed since the last step."""
        vec, size = self._vec, self._size
        self._vec, self._size = None, 0
        return size, vec

    @staticmethod
    def decode(values: list[float], size: int, stats: StepStats) -> None:
        if not size:
            return
        stats.sample_hashes = [int(v) for v in values[:size]]
        stats.nonfinite_samples = [i for i, v in enumerate(values[size : 2 * size]) if v]
        flags = values[2 * size :]
        stats.batch_tensors = len(flags)
        stats.nonfinite_tensors = [i for i, v in enumerate(flags) if v]


def _combine(h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Order-dependent combination of two 52-bit fingerprints, exact in int64."""
    return ((h.to(torch.int64) * 1000003 + f.to(torch.int64)) & _MASK).to(torch.float64)
