"""What the guard learns about the batch it is handed: per-sample fingerprints and NaN rows.

Everything stays on the device until the step's single host read. The batch itself is kept by
reference (no copy) as `last`, for an in-process replay of the step.

The per-step cost is a few tensor ops per batch tensor: the fingerprint (one integer
matrix-vector product on the CPU, see `fingerprint`) and, for floating-point tensors, ONE row
sum, in float32 (float64 for float64 data: a float64 reduction of float32 data costs ~40x more
on the CPU, 98 ms on a 128 x 3 x 224 x 224 batch). A row's sum is NaN or infinite when one of
its elements is, so the host reads the NaN rows straight from the sums, as they were at `watch`
time: on the quiet step no other op and no other read. A non-finite row sum may also be a sum
of huge finite values that overflowed: those rows alone are checked element by element
(`_confirm`, one extra read on such a step), so an overflowing finite sum is never called NaN.

A small CPU batch (`_HOST_COMBINE_MAX` samples at most) is host memory already: nothing of it
goes into the step's read (`BatchProbe.observe` measures it on the host). Its per-tensor
fingerprint sums are read, combined and encoded by the run store's writer thread (a quiet
step's training thread never reads them: `StepStats.defer_hashes`), and its finiteness is one
total sum per floating-point tensor read at `watch` time; only a tensor whose total is not
finite (a NaN or Inf, or finite values whose sum overflows) is checked row by row, element by
element.
"""

from __future__ import annotations

import math
from itertools import repeat
from typing import Any

import torch

from nanguard.watch.fingerprint import sample_sums, weights
from nanguard.watch.stats import StepStats
from nanguard.watch.taken import CPU, Micro, Taken, combined, confirm, exact, exact_flags, mask

_MASK = (1 << 52) - 1
_MAX_MICRO_BATCHES = 1024


def batch_tensors(batch: Any) -> list[torch.Tensor]:
    """The tensors in a batch: a tensor, or a tuple / list / dict of them (nested ok)."""
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, (list, tuple)) and all(map(isinstance, batch, repeat(torch.Tensor))):
        return list(batch)  # the common (x, y): no call per element
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
        self.parts: list[Micro] = []
        """The micro-batches of this step, as observed."""
        self.dropped: list[int] | None = None
        """NaN rows of a batch whose optimizer step never came (a GradScaler skipped it on
        the fp16 overflow its NaN caused): the data fault is real and is reported with the
        next step the guard sees."""

    def _keep_dropped(self) -> None:
        """A batch is replaced with no optimizer step in between: keep its NaN rows. One host
        read, only on steps the GradScaler skipped (a handful per run)."""
        rows, _ = exact(self.parts)
        if rows:
            self.dropped = rows

    def observe(self, batch: Any, accumulate: bool = True) -> None:
        """Fingerprint `batch` on the device. With `accumulate`, batches observed since the last
        `collect` are micro-batches of one step and are all kept; without, only the last."""
        # The tensors with a batch dimension, those of the first one's size (a loop: no
        # comprehension calls on every step).
        tensors: list[torch.Tensor] = []
        size = -1
        # `batch_tensors`, its common (x, y) inline: no call on the quiet step.
        found = list(batch) if type(batch) is tuple and all(
            map(isinstance, batch, repeat(torch.Tensor))) else batch_tensors(batch)
        for t in found:
            if t.dim() > 0:
                if size < 0:
                    size = t.shape[0]
                if t.shape[0] == size:
                    tensors.append(t)
        if not accumulate and self.batches:
            self.skipped, self.batches = self.batches, []
            if self.parts and self.dropped is None:
                self._keep_dropped()
        self.last = batch
        self.batches.append(batch)
        if len(self.batches) > _MAX_MICRO_BATCHES:  # watch() in a loop with no step at all
            del self.batches[0]
            del self.parts[:1]
        if not tensors:
            return
        micro = None
        if size <= _HOST_COMBINE_MAX:
            # A small CPU micro-batch, measured on the host: each tensor's `sample_sums` (its
            # common case, a contiguous 1-D or 2-D tensor of 4- or 8-byte elements, inline:
            # the same view and `mv`, no call per tensor on the quiet step), and the NaN /
            # Inf rows of each floating-point or complex tensor whose total is not finite,
            # checked element by element. A tensor off the CPU: measured on its device.
            sums: list[torch.Tensor] = []
            checked: list[tuple[int, torch.Tensor]] = []
            bad: list[tuple[int, list[int]]] | None = None
            for k, t in enumerate(tensors):
                if not t.is_cpu:
                    break
                if t.requires_grad:
                    t = t.detach()
                wide = _WIDE.get(t.dtype)
                dim = t.dim()
                if wide is not None and dim <= 2 and t.is_contiguous():
                    bits = t.view(wide) if dim == 2 else t.view(wide).view(size, 1)
                    width = bits.shape[1]
                    w = _CPU_WEIGHTS.get((width, wide))
                    if w is None:
                        w = _CPU_WEIGHTS[(width, wide)] = weights(width, CPU, wide)
                    sums.append(torch.mv(bits, w))
                else:
                    sums.append(sample_sums(t))
                acc = _ACC.get(t.dtype)
                if acc is None:
                    if t.is_floating_point():  # another float dtype: summed in float32
                        acc = torch.float32
                    elif t.is_complex():
                        checked.append((k, t))
                    else:
                        continue
                if acc is not None:
                    checked.append((k, t))
                    # One total, read at once: not finite when an element is NaN or Inf, or
                    # when finite elements overflow it (then the element by element check
                    # below finds no row). A row sum and its `tolist()` cost more.
                    if _isfinite((t.sum() if acc is t.dtype else t.sum(dtype=acc)).item()):
                        continue
                ok: list[bool] = torch.isfinite(t).reshape(size, -1).all(dim=1).tolist()
                rows = [i for i, v in enumerate(ok) if not v]
                if rows:
                    bad = (bad or []) + [(k, rows)]
            else:
                micro = Micro(size, len(tensors), None, checked, [], sums, bad)
        if micro is None:
            micro = self._device_micro(tensors, size, tensors[0].device)
        if accumulate and self.parts and self.parts[-1].n == micro.n:
            # Another micro-batch of the same step (gradient accumulation, the last one
            # possibly smaller): the step's samples are the micro-batches one after the other,
            # so a NaN row of any of them keeps its place (index = offset + row).
            self.parts.append(micro)
        else:
            self.parts = [micro]

    @staticmethod
    def _device_micro(tensors: list[torch.Tensor], size: int, device: torch.device) -> Micro:
        """Fingerprints and row sums of a micro-batch, as device ops (no read)."""
        sums: list[torch.Tensor] = []
        checked: list[tuple[int, torch.Tensor]] = []
        rows: list[torch.Tensor] = []
        for k, t in enumerate(tensors):
            if t.requires_grad:
                t = t.detach()
            f = sample_sums(t)
            sums.append(f if f.device == device else f.to(device))
            if t.is_floating_point():
                checked.append((k, t))
                acc = torch.float64 if t.dtype == torch.float64 else torch.float32
                # The common 2-D batch tensor: one row sum as it is (no reshape, no dim tuple).
                r = (t.sum(dim=1, dtype=acc) if t.dim() == 2
                     else t.reshape(size, -1).sum(dim=1, dtype=acc))
            elif t.is_complex():
                checked.append((k, t))
                acc = torch.float64 if t.dtype == torch.complex128 else torch.float32
                r = torch.view_as_real(t.reshape(size, -1)).sum(dim=(1, 2), dtype=acc)
            else:
                continue
            rows.append(r if r.device == device else r.to(device))
        return Micro(size, len(tensors), combined(sums), checked, rows)

    def take(self) -> Taken:
        """Take what was observed since the last step, for the step's packet."""
        parts, self.parts = self.parts, []
        self.step_batches, self.batches = self.batches, []
        return self.gather(parts)

    @staticmethod
    def gather(parts: list[Micro]) -> Taken:
        """The step's batch from its micro-batches `parts` (`take`; the quiet lane takes
        them itself)."""
        if not parts:
            return Taken()
        size, host = 0, True  # a loop: no generator call per part on every step
        for p in parts:
            size += p.size
            host = host and p.hashes is None
        if host:  # measured on the host: nothing to read (`decode_taken`)
            return Taken(size=size, n=parts[0].n, micro=parts, host=True)
        for p in parts:
            if p.hashes is None:
                p.to_device()
        device = parts[0].device
        h = parts[0].device_hashes() if len(parts) == 1 else torch.cat(
            [p.device_hashes().to(device) for p in parts])
        return Taken(size=size, n=parts[0].n, hashes=torch.bitwise_and(h, mask(h.device)),
                     micro=parts)

    def collect(self) -> tuple[int, torch.Tensor | None]:
        """`take`, with the NaN rows and per-tensor flags computed exactly on the device: (number
        of samples, one float64 vector of fingerprints, NaN-row flags and per-tensor flags) or
        (0, None). For a read outside the step's packet (`Guard.close`)."""
        taken = self.take()
        if taken.micro is None:
            return 0, None
        bad, flags = exact_flags(taken.micro)
        h = taken.hashes
        if h is None:
            h = torch.cat([m.device_hashes() for m in taken.micro])
            h = torch.bitwise_and(h, mask(h.device))
        return taken.size, torch.cat([h, bad.to(h.device), flags.to(h.device)]).to(torch.float64)

    @staticmethod
    def decode_taken(slots: dict[str, list[float]], taken: Taken, stats: StepStats) -> None:
        """Fill `stats` from the host copy of the slot `Taken.add_to` added (nothing of a
        batch measured on the host: `_decode_host`). The quiet step costs one C-level sum over
        every row sum: finite, no NaN row."""
        if not taken.size or taken.micro is None:
            return
        if taken.host:
            decode_host(taken, stats)
            return
        values = slots["batch"]
        size = start = taken.size
        stats.sample_hashes = list(map(int, values[:size]))
        stats.batch_tensors = taken.n
        if math.isfinite(sum(values[start:])):
            return  # the quiet step: every row of every tensor is finite
        bad_rows: set[int] = set()
        bad_tensors: set[int] = set()
        pos, offset = start, 0
        for m in taken.micro:
            for k, t in m.checked:
                sums = values[pos : pos + m.size]
                pos += m.size
                if math.isfinite(sum(sums)):
                    continue
                rows = [i for i, v in enumerate(sums) if not math.isfinite(v)]
                rows = confirm(t, m.size, rows)  # may be an overflow of finite values
                if rows:
                    bad_rows.update(offset + i for i in rows)
                    bad_tensors.add(k)
            offset += m.size
        stats.nonfinite_samples = sorted(bad_rows)
        stats.nonfinite_tensors = sorted(bad_tensors)

    @staticmethod
    def decode(values: list[float], size: int, stats: StepStats) -> None:
        """Fill `stats` from the host copy of `collect`'s vector."""
        if not size:
            return
        stats.sample_hashes = list(map(int, values[:size]))
        rows = values[size : 2 * size]
        # Almost always no NaN row: one C-level scan instead of a Python loop over the batch.
        stats.nonfinite_samples = [i for i, v in enumerate(rows) if v] if any(rows) else []
        flags = values[2 * size :]
        stats.batch_tensors = len(flags)
        stats.nonfinite_tensors = [i for i, v in enumerate(flags) if v]


_HOST_COMBINE_MAX = 256
"""Largest CPU micro-batch measured on the host (`BatchProbe.observe`). Its per-tensor sums are
combined in Python, on the run store's writer thread (`record.writer.combine_sums`: ~0.1 us
per sample and tensor); the three tensor ops that would combine them take 10-15 us warm and
3-4x that in a training step's cold caches: measured in the step (ab_inprocess.py), the host
wins at 128 samples (7% of the guard's cost on the MLP)."""


_isfinite = math.isfinite
_WIDE = {torch.float32: torch.int32, torch.int32: torch.int32,
         torch.float64: torch.int64, torch.int64: torch.int64}
"""dtype -> its `sample_sums` integer view, where the view is the sum's own width (no
widening)."""
_ACC = {torch.float32: torch.float32, torch.float16: torch.float32,
        torch.bfloat16: torch.float32, torch.float64: torch.float64}
"""A floating-point dtype -> the dtype its finiteness total is summed in (any other float
dtype: float32)."""
_CPU_WEIGHTS: dict[tuple[int, torch.dtype], torch.Tensor] = {}
"""`fingerprint.weights` on the CPU, by (width, integer dtype), made once each."""


def decode_host(taken: Taken, stats: StepStats) -> None:
    """Fill `stats` from a step's batch measured on the host (`Taken.host`; the quiet lane
    calls it itself): its micro-batches' per-tensor sums, read and
    combined when first asked for (on the writer thread for a quiet step:
    `StepStats.defer_hashes`; the sums are tensors of their own, and sizes only: the queued row
    must not hold the batch's tensors), and the NaN / Inf rows and tensors found when
    observed."""
    micro, n = taken.micro, taken.n
    assert micro is not None
    values: list[torch.Tensor] = []
    bad_rows: set[int] = set()
    bad_tensors: set[int] = set()
    offset = 0
    for m in micro:
        values += m.sums or ()
        for k, rows in m.bad or ():
            bad_rows.update(offset + i for i in rows)
            bad_tensors.add(k)
        offset += m.size
    sizes = (micro[0].size,) if len(micro) == 1 else tuple(m.size for m in micro)
    stats.defer_hashes((values, n, sizes))
    stats.batch_tensors = n
    if bad_tensors:
        stats.nonfinite_samples = sorted(bad_rows)
        stats.nonfinite_tensors = sorted(bad_tensors)


def _combine(h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Order-dependent combination of two 52-bit fingerprints, exact in int64 (the definition
    `observe` computes in int64 with one mask at the end)."""
    return ((h.to(torch.int64) * 1000003 + f.to(torch.int64)) & _MASK).to(torch.float64)
