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
_MAX_MICRO_BATCHES = 1024


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
        """The last batch observed (by reference)."""
        self.batches: list[Any] = []
        """Every micro-batch observed since the last `collect` (by reference), in order: what
        an in-process replay of the step runs."""
        self.step_batches: list[Any] = []
        """The micro-batches of the step last collected."""
        self.skipped: list[Any] = []
        """The micro-batches of a step whose optimizer step never came (a GradScaler skipped
        it): replayed in float32 to tell a real fault from an fp16 overflow."""
        self._parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """(fingerprints, NaN-row flags, per-tensor flags) of each micro-batch of this step."""
        self.dropped: list[int] | None = None
        """NaN rows of a batch whose optimizer step never came (a GradScaler skipped it on
        the fp16 overflow its NaN caused): the data fault is real and is reported with the
        next step the guard sees."""

    def _keep_dropped(self) -> None:
        """A batch is replaced with no optimizer step in between: keep its NaN rows. One host
        read, only on steps the GradScaler skipped (a handful per run)."""
        bad = torch.cat([p[1] for p in self._parts])
        rows: list[int] = bad.nonzero().flatten().tolist()
        if rows:
            self.dropped = rows

    def observe(self, batch: Any, accumulate: bool = True) -> None:
        """Fingerprint `batch` on the device. With `accumulate`, batches observed since the last
        `collect` are micro-batches of one step and are all kept; without, only the last."""
        tensors = [t for t in batch_tensors(batch) if t.dim() > 0]
        if not accumulate and self.batches:
            self.skipped, self.batches = self.batches, []
            if self._parts and self.dropped is None:
                self._keep_dropped()
        self.last = batch
        self.batches.append(batch)
        if len(self.batches) > _MAX_MICRO_BATCHES:  # watch() in a loop with no step at all
            del self.batches[0]
            del self._parts[:1]
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
        flags = torch.stack(per_tensor).double()
        if accumulate and self._parts and self._parts[-1][2].shape == flags.shape:
            # Another micro-batch of the same step (gradient accumulation, the last one
            # possibly smaller): the step's samples are the micro-batches one after the other,
            # so a NaN row of any of them keeps its place (index = offset + row).
            self._parts.append((h, bad.double(), flags))
        else:
            self._parts = [(h, bad.double(), flags)]

    def collect(self) -> tuple[int, torch.Tensor | None]:
        """Take what was observed since the last step: (number of samples, one vector of
        fingerprints, NaN-row flags and per-tensor flags) or (0, None)."""
        parts, self._parts = self._parts, []
        self.step_batches, self.batches = self.batches, []
        if not parts:
            return 0, None
        if len(parts) == 1:
            h, bad, flags = parts[0]
        else:
            device = parts[0][0].device
            h = torch.cat([p[0].to(device) for p in parts])
            bad = torch.cat([p[1].to(device) for p in parts])
            flags = torch.stack([p[2].to(device) for p in parts]).amax(dim=0)
        return h.numel(), torch.cat([h, bad, flags.to(h.device)])

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
