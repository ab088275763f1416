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
goes into the step's read (`_host_micro`). Its per-tensor fingerprint sums are read, combined
and encoded by the run store's writer thread (a quiet step's training thread never reads them:
`StepStats.defer_hashes`), and its finiteness is one total sum per floating-point tensor read
at `watch` time; only a tensor whose total is not finite (a NaN or Inf, or finite values whose
sum overflows) is checked row by row, element by element.
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
    """Unmasked int64 fingerprints (see `sample_sums`), [size]; None on the host (`host`)."""
    checked: list[tuple[int, torch.Tensor]]
    """(index, detached tensor) of its floating-point / complex tensors, kept by reference
    (for `exact` and `_confirm`)."""
    rows: list[torch.Tensor]
    """One row sum [size] per checked tensor (float32; float64 for float64 data): non-finite on
    a row holding a NaN / Inf, or on a row of finite values whose sum overflows. Empty on the
    host (`host`)."""
    sums: list[torch.Tensor] | None = None
    """On the host: each tensor's `sample_sums` (int32 or int64 CPU tensors)."""
    bad: list[tuple[int, list[int]]] | None = None
    """On the host: (index, its NaN / Inf rows) of each checked tensor holding one, checked
    element by element when observed."""

    @property
    def device(self) -> torch.device:
        return _CPU if self.hashes is None else self.hashes.device

    def device_hashes(self) -> torch.Tensor:
        """The unmasked int64 fingerprints as a tensor (`hashes`, or the host's sums combined)."""
        if self.hashes is None:
            assert self.sums is not None
            self.hashes = _combined(self.sums)
        return self.hashes

    def to_device(self) -> None:
        """A host micro-batch in a step with micro-batches measured on the device (a
        gradient-accumulation step whose micro-batches straddle `_HOST_COMBINE_MAX`), made
        what those carry: combined fingerprints, and per checked tensor a row vector that is
        NaN on its non-finite rows (`decode_taken` confirms them element by element)."""
        bad = dict(self.bad or ())
        rows = []
        for k, _ in self.checked:
            r = torch.zeros(self.size)
            if k in bad:
                r[bad[k]] = math.nan
            rows.append(r)
        self.device_hashes()
        self.rows, self.sums, self.bad = rows, None, None


@dataclass
class Taken:
    """A step's batch, taken by `BatchProbe.take` for the packet (`add_to`: slots `batch`,
    `batch_rows.<j>`) and decoded by `BatchProbe.decode_taken`."""

    size: int = 0
    """Samples of the step (micro-batches one after the other)."""
    n: int = 0
    """Tensors per sample."""
    hashes: torch.Tensor | None = None
    """Masked int64 fingerprints, [size]; None when every micro-batch was measured on the
    host (`host`)."""
    micro: list[_Micro] | None = None
    host: bool = False
    """Every micro-batch was measured on the host: nothing to read (`decode_taken`)."""

    def add_to(self, packet: Packet) -> None:
        """Add the fingerprints and the row sums to the step's packet as its one slot `batch`
        (nothing if no batch, or a batch measured on the host): the `size` fingerprints, then
        each micro-batch's row sums in order."""
        if self.micro is not None and not self.host:
            packet.add_vectors("batch", self.vectors())

    def vectors(self) -> list[torch.Tensor]:
        """The slot's vectors, in order (`add_to`; the quiet lane reads them without a
        packet): none for a batch measured on the host."""
        if self.host or self.micro is None:
            return []
        assert self.hashes is not None
        if len(self.micro) == 1:  # the common step: no comprehension call
            return [self.hashes, *self.micro[0].rows]
        return [self.hashes, *[r for m in self.micro for r in m.rows]]


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
        micro = _host_micro(tensors, size) if device.type == "cpu" and \
            size <= _HOST_COMBINE_MAX else None
        if micro is None:
            micro = self._device_micro(tensors, size, device)
        if accumulate and self._parts and self._parts[-1].n == micro.n:
            # Another micro-batch of the same step (gradient accumulation, the last one
            # possibly smaller): the step's samples are the micro-batches one after the other,
            # so a NaN row of any of them keeps its place (index = offset + row).
            self._parts.append(micro)
        else:
            self._parts = [micro]

    @staticmethod
    def _device_micro(tensors: list[torch.Tensor], size: int, device: torch.device) -> _Micro:
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
        return _Micro(size, len(tensors), _combined(sums), checked, rows)

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
        if host:  # measured on the host: nothing to read (`decode_taken`)
            return Taken(size=size, n=parts[0].n, micro=parts, host=True)
        for p in parts:
            if p.hashes is None:
                p.to_device()
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
"""Largest CPU micro-batch measured on the host (`_host_micro`). Its per-tensor sums are
combined in Python, on the run store's writer thread (`record.writer.combine_sums`: ~0.1 us
per sample and tensor); the three tensor ops that would combine them take 10-15 us warm and
3-4x that in a training step's cold caches: measured in the step (ab_inprocess.py), the host
wins at 128 samples (7% of the guard's cost on the MLP)."""

_CPU = torch.device("cpu")


def _host_micro(tensors: list[torch.Tensor], size: int) -> _Micro | None:
    """A small CPU micro-batch measured on the host: each tensor's `sample_sums`, and the
    NaN / Inf rows of each floating-point or complex tensor whose total is not finite, checked
    element by element. None if a tensor is not on the CPU."""
    sums: list[torch.Tensor] = []
    checked: list[tuple[int, torch.Tensor]] = []
    bad: list[tuple[int, list[int]]] | None = None
    for k, t in enumerate(tensors):
        if t.device.type != "cpu":
            return None
        if t.requires_grad:
            t = t.detach()
        sums.append(sample_sums(t))
        if t.is_floating_point():
            checked.append((k, t))
            # One total (float32; float64 for float64 data), read at once: not finite when an
            # element is NaN or Inf, or when finite elements overflow it (then the element by
            # element check below finds no row). A row sum and its `tolist()` cost more.
            acc = torch.float64 if t.dtype == torch.float64 else torch.float32
            if _isfinite(t.sum(dtype=acc).item()):
                continue
        elif t.is_complex():
            checked.append((k, t))
        else:
            continue
        ok: list[bool] = torch.isfinite(t).reshape(size, -1).all(dim=1).tolist()
        rows = [i for i, v in enumerate(ok) if not v]
        if rows:
            bad = (bad or []) + [(k, rows)]
    return _Micro(size, len(tensors), None, checked, [], sums, bad)


_isfinite = math.isfinite


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
