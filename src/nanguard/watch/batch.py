"""What the guard learns about the batch it is handed: per-sample fingerprints and NaN rows.

Everything stays on the device until the step's single host read. The batch itself is kept by
reference (no copy) as `last`, for an in-process replay of the step.
"""

from __future__ import annotations

from typing import Any

import torch

from nanguard.watch.fingerprint import sample_sums
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
        """(fingerprints as int64, NaN-row flags, per-tensor flags as bool) of each micro-batch
        of this step; made float64 once, in `collect`."""
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
        # A handful of small tensor ops per batch tensor: on a small model each op's dispatch
        # (a few microseconds) is what costs, not the arithmetic. The fingerprints combine in
        # int64 and are masked once (see `sample_sums`). The finite check is the row sum of
        # t * 0: every product is +-0 unless the element is NaN or +-inf (inf * 0 is NaN), so
        # the sum is NaN exactly for the rows holding one, and it cannot overflow (two kernels;
        # `torch.isfinite` is four). The rows' NaNs are reduced across tensors once.
        device = tensors[0].device
        h: torch.Tensor | None = None
        finite: list[torch.Tensor | None] = []  # per tensor: NaN on a bad row (None: ints)
        for t in tensors:
            t = t.detach()
            f = sample_sums(t)
            if f.device != device:
                f = f.to(device)
            # h * 1000003 + f, as `_combine` did, masked below.
            h = f if h is None else torch.add(f, h, alpha=1000003)
            if t.is_floating_point() or t.is_complex():
                z = (t.reshape(size, -1) * 0).sum(dim=1)
                finite.append(z if z.device == device else z.to(device))
            else:
                finite.append(None)
        assert h is not None
        h = h & _MASK
        bad, flags = _nonfinite(finite, size, device)
        if accumulate and self._parts and self._parts[-1][2].shape == flags.shape:
            # Another micro-batch of the same step (gradient accumulation, the last one
            # possibly smaller): the step's samples are the micro-batches one after the other,
            # so a NaN row of any of them keeps its place (index = offset + row).
            self._parts.append((h, bad, flags))
        else:
            self._parts = [(h, bad, flags)]

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
            flags = torch.stack([p[2].to(device) for p in parts]).any(dim=0)
        # One cat (int64 with bools promotes to int64) and one conversion: every value is an
        # integer below 2**52, exact in float64.
        return h.numel(), torch.cat([h, bad, flags.to(h.device)]).to(torch.float64)

    @staticmethod
    def decode(values: list[float], size: int, stats: StepStats) -> None:
        if not size:
            return
        stats.sample_hashes = list(map(int, values[:size]))
        rows = values[size : 2 * size]
        # Almost always no NaN row: one C-level scan instead of a Python loop over the batch.
        stats.nonfinite_samples = [i for i, v in enumerate(rows) if v] if any(rows) else []
        flags = values[2 * size :]
        stats.batch_tensors = len(flags)
        stats.nonfinite_tensors = [i for i, v in enumerate(flags) if v]


def _nonfinite(
    finite: list[torch.Tensor | None], size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(NaN-row flags [size], per-tensor flags [len(finite)]) from each tensor's row sums of
    t * 0 (NaN on a row holding a NaN or Inf; None for integer tensors)."""
    checked = [z for z in finite if z is not None]
    if not checked:
        return (torch.zeros(size, dtype=torch.bool, device=device),
                torch.zeros(len(finite), dtype=torch.bool, device=device))
    # stack promotes mixed float / complex dtypes; a NaN stays a NaN.
    nan = torch.isnan(torch.stack(checked))
    bad = nan.any(dim=0)
    per_checked = nan.any(dim=1)
    if len(checked) == len(finite):
        return bad, per_checked
    flags = torch.zeros(len(finite), dtype=torch.bool, device=device)
    flags[[i for i, ok in enumerate(finite) if ok is not None]] = per_checked
    return bad, flags


def _combine(h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Order-dependent combination of two 52-bit fingerprints, exact in int64 (the definition
    `observe` computes in int64 with one mask at the end)."""
    return ((h.to(torch.int64) * 1000003 + f.to(torch.int64)) & _MASK).to(torch.float64)
