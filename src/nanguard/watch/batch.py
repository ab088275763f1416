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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch

from nanguard.watch.fingerprint import sample_sums
from nanguard.watch.packet import Packet
from nanguard.watch.stats import StepStats

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


@dataclass
class _Micro:
    """One observed micro-batch, on the device."""

    size: int
    n: int
    """Number of its tensors (those sharing the leading dimension)."""
    hashes: torch.Tensor | None
    """Unmasked int64 fingerprints (see `sample_sums`), [size]; None when `sums` holds them
    uncombined (a small CPU batch: combined on the host)."""
    checked: list[tuple[int, torch.Tensor]]
    """(index, detached tensor) of its floating-point / complex tensors, kept by reference
    (for `exact` and `_confirm`)."""
    rows: list[torch.Tensor]
    """One row sum [size] per checked tensor (float32; float64 for float64 data): non-finite on
    a row holding a NaN / Inf, or on a row of finite values whose sum overflows."""
    sums: list[torch.Tensor] | None = None
    """Each tensor's `sample_sums` (int32 or int64), when `hashes` is None."""

    @property
    def device(self) -> torch.device:
        t = self.hashes if self.hashes is not None else self.sums[0] if self.sums else None
        assert t is not None, "a micro-batch has fingerprints or sums"
        return t.device

    def device_hashes(self) -> torch.Tensor:
        """The unmasked int64 fingerprints on the device (`hashes`, or `sums` combined)."""
        if self.hashes is None:
            assert self.sums is not None
            self.hashes = _combined(self.sums)
        return self.hashes


@dataclass
class Taken:
    """A step's batch, taken by `BatchProbe.take` for the packet (`add_to`: slots `batch`,
    `batch_rows.<j>`) and decoded by `BatchProbe.decode_taken`."""

    size: int = 0
    """Samples of the step (micro-batches one after the other)."""
    n: int = 0
    """Tensors per sample."""
    hashes: torch.Tensor | None = None
    """Masked int64 fingerprints, [size]; None while each micro-batch's per-tensor sums travel
    uncombined, for the host to combine (`add_to`)."""
    micro: list[_Micro] | None = None

    def add_to(self, packet: Packet) -> None:
        """Add the fingerprints and the row sums to the step's packet as its one slot `batch`
        (nothing if no batch): the `size` fingerprints, then each micro-batch's row sums in
        order. A CPU packet of small micro-batches carries each tensor's sums instead of the
        fingerprints (micro-batch by micro-batch), read exactly as integers and combined by
        `decode_taken`: three fewer tensor ops a step than combining them here."""
        if self.micro is not None:
            packet.add_vectors("batch", self.vectors(packet.device.type == "cpu"))

    def vectors(self, cpu: bool) -> list[torch.Tensor]:
        """The slot's vectors, in order (`add_to`; the quiet lane reads them without a
        packet). `cpu`: they are read on the CPU, where small micro-batches' per-tensor sums
        travel uncombined. Only with a batch (`micro` set)."""
        assert self.micro is not None
        if len(self.micro) == 1:  # the common step: no comprehension calls
            m = self.micro[0]
            if self.hashes is None and cpu:
                return [*(m.sums or ()), *m.rows]
            rows = m.rows
        else:
            rows = [r for m in self.micro for r in m.rows]
        if self.hashes is None and cpu:
            return [f for m in self.micro for f in m.sums or ()] + rows
        if self.hashes is None:  # a float64 packet holds 52-bit integers exactly, not int64
            h = torch.cat([m.device_hashes() for m in self.micro]) if len(self.micro) > 1 \
                else self.micro[0].device_hashes()
            self.hashes = torch.bitwise_and(h, _mask(h.device))
        return [self.hashes, *rows]


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
        self._parts: list[_Micro] = []
        """The micro-batches of this step, as observed."""
        self.dropped: list[int] | None = None
        """NaN rows of a batch whose optimizer step never came (a GradScaler skipped it on
        the fp16 overflow its NaN caused): the data fault is real and is reported with the
        next step the guard sees."""

    def _keep_dropped(self) -> None:
        """A batch is replaced with no optimizer step in between: keep its NaN rows. One host
        read, only on steps the GradScaler skipped (a handful per run)."""
        rows, _ = exact(self._parts)
        if rows:
            self.dropped = rows

    def observe(self, batch: Any, accumulate: bool = True) -> None:
        """Fingerprint `batch` on the device. With `accumulate`, batches observed since the last
        `collect` are micro-batches of one step and are all kept; without, only the last."""
        # The tensors with a batch dimension, those of the first one's size (a loop: no
        # comprehension calls on every step).
        tensors: list[torch.Tensor] = []
        size = -1
        for t in batch_tensors(batch):
            if t.dim() > 0:
                if size < 0:
                    size = t.shape[0]
                if t.shape[0] == size:
                    tensors.append(t)
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
        device = tensors[0].device
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
        if device.type == "cpu" and size <= _HOST_COMBINE_MAX:
            micro = _Micro(size, len(tensors), None, checked, rows, sums)
        else:
            micro = _Micro(size, len(tensors), _combined(sums), checked, rows)
        if accumulate and self._parts and self._parts[-1].n == micro.n:
            # Another micro-batch of the same step (gradient accumulation, the last one
            # possibly smaller): the step's samples are the micro-batches one after the other,
            # so a NaN row of any of them keeps its place (index = offset + row).
            self._parts.append(micro)
        else:
            self._parts = [micro]

    def take(self) -> Taken:
        """Take what was observed since the last step, for the step's packet."""
        parts, self._parts = self._parts, []
        self.step_batches, self.batches = self.batches, []
        if not parts:
            return Taken()
        size, host = 0, True  # a loop: no generator call per part on every step
        for p in parts:
            size += p.size
            host = host and p.hashes is None
        if host:  # combined on the host (`Taken.add_to`)
            return Taken(size=size, n=parts[0].n, micro=parts)
        device = parts[0].device
        h = parts[0].device_hashes() if len(parts) == 1 else torch.cat(
            [p.device_hashes().to(device) for p in parts])
        return Taken(size=size, n=parts[0].n, hashes=torch.bitwise_and(h, _mask(h.device)),
                     micro=parts)

    def collect(self) -> tuple[int, torch.Tensor | None]:
        """`take`, with the NaN rows and per-tensor flags computed exactly on the device: (number
        of samples, one float64 vector of fingerprints, NaN-row flags and per-tensor flags) or
        (0, None). For a read outside the step's packet (`Guard.close`)."""
        taken = self.take()
        if taken.micro is None:
            return 0, None
        bad, flags = _exact_flags(taken.micro)
        h = taken.hashes
        if h is None:
            h = torch.cat([m.device_hashes() for m in taken.micro])
            h = torch.bitwise_and(h, _mask(h.device))
        return taken.size, torch.cat([h, bad.to(h.device), flags.to(h.device)]).to(torch.float64)

    @staticmethod
    def decode_taken(slots: dict[str, list[float]], taken: Taken, stats: StepStats) -> None:
        """Fill `stats` from the host copy of the slot `Taken.add_to` added. The quiet step
        costs one C-level sum over every row sum: finite, no NaN row."""
        if not taken.size or taken.micro is None:
            return
        values = slots["batch"]
        size = taken.size
        if taken.hashes is None:  # each tensor's sums, exact integers: combined when read
            # (on the writer thread for a quiet step: `StepStats.defer_hashes`). Sizes only:
            # the queued row must not hold the batch's tensors.
            micro = taken.micro
            sizes = (micro[0].size,) if len(micro) == 1 else tuple(m.size for m in micro)
            stats.defer_hashes((values, taken.n, sizes))
            start = size * taken.n
        else:
            stats.sample_hashes = list(map(int, values[:size]))
            start = size
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
                rows = _confirm(t, m.size, rows)  # may be an overflow of finite values
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
"""Largest CPU micro-batch whose per-tensor sums the host combines. Python takes ~0.1 us per
sample and tensor; the three tensor ops it replaces (int64 conversion, add, mask) take 10-15 us
warm and 3-4x that in a training step's cold caches: measured in the step (ab_inprocess.py),
the host wins at 128 samples (7% of the guard's cost on the MLP). numpy on the same memory
(8 us warm) measured slower than either in the step."""


def _combined(sums: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's `sample_sums` combined into unmasked int64 fingerprints, on the device:
    h * 1000003 + f in wrapping int64, as `_combine` defines it (masked once, later)."""
    h = sums[0] if sums[0].dtype == torch.int64 else sums[0].to(torch.int64)
    for f in sums[1:]:
        h = torch.add(f, h, alpha=1000003)  # h is int64: f is promoted
    return h


def _exact_flags(parts: list[_Micro]) -> tuple[torch.Tensor, torch.Tensor]:
    """(NaN-row flags [samples], per-tensor flags [n]) of `parts`, element by element (device
    ops; no read)."""
    device = parts[0].device
    rows: list[torch.Tensor] = []
    flags = torch.zeros(parts[0].n, dtype=torch.bool, device=device)
    for p in parts:
        bad = torch.zeros(p.size, dtype=torch.bool, device=device)
        for k, t in p.checked:
            r = torch.logical_not(torch.isfinite(t)).reshape(p.size, -1).any(dim=1).to(device)
            bad |= r
            flags[k] |= r.any()
        rows.append(bad)
    return (rows[0] if len(rows) == 1 else torch.cat(rows)), flags


def exact(parts: list[_Micro]) -> tuple[list[int], list[int]]:
    """(indices of the samples holding a NaN / Inf, indices of the tensors holding one), checked
    element by element: one host read. For a batch dropped with no step (`_keep_dropped`)."""
    bad, flags = _exact_flags(parts)
    values: list[float] = torch.cat([bad, flags.to(bad.device)]).tolist()
    size = bad.numel()
    return ([i for i, v in enumerate(values[:size]) if v],
            [i for i, v in enumerate(values[size:]) if v])


def _confirm(t: torch.Tensor, size: int, rows: list[int]) -> list[int]:
    """Those of `rows` of `t` (rows whose sums came back non-finite) that hold a NaN or Inf,
    element by element: one host read, on such a step only."""
    picked = t.reshape(size, -1)[rows]
    finite: list[bool] = torch.isfinite(picked).all(dim=1).tolist()
    return [r for r, ok in zip(rows, finite, strict=True) if not ok]


_MASKS: dict[torch.device, torch.Tensor] = {}


def _mask(device: torch.device) -> torch.Tensor:
    """`_MASK` as a 0-dim int64 tensor on `device`, made once (a Python int operand is wrapped
    into a new tensor at every call). Filled on the device: `torch.tensor(..., device=cuda)`
    would copy from pageable host memory, a synchronizing call."""
    m = _MASKS.get(device)
    if m is None:
        m = _MASKS[device] = torch.full((), _MASK, dtype=torch.int64, device=device)
    return m


def _combine(h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """Order-dependent combination of two 52-bit fingerprints, exact in int64 (the definition
    `observe` computes in int64 with one mask at the end)."""
    return ((h.to(torch.int64) * 1000003 + f.to(torch.int64)) & _MASK).to(torch.float64)
