"""A step's batch as the batch probe measured it: its micro-batches (`Micro`) and what the
step takes of them (`Taken`), with the exact checks of non-finite rows (element by element,
one host read, only on a step whose sums came back non-finite).

The fingerprints are those `watch.fingerprint` defines: each tensor's `sample_sums`, combined
h * 1000003 + f in wrapping int64 (`combined`) and masked to 52 bits once (`mask`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nanguard.watch.packet import Packet

MASK = (1 << 52) - 1
CPU = torch.device("cpu")


@dataclass
class Micro:
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
        return CPU if self.hashes is None else self.hashes.device

    def device_hashes(self) -> torch.Tensor:
        """The unmasked int64 fingerprints as a tensor (`hashes`, or the host's sums combined)."""
        if self.hashes is None:
            assert self.sums is not None
            self.hashes = combined(self.sums)
        return self.hashes

    def to_device(self) -> None:
        """A host micro-batch in a step with micro-batches measured on the device (a
        gradient-accumulation step whose micro-batches straddle `batch._HOST_COMBINE_MAX`), made
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
    micro: list[Micro] | None = None
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


def combined(sums: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's `sample_sums` combined into unmasked int64 fingerprints, on the device:
    h * 1000003 + f in wrapping int64, as `_combine` defines it (masked once, later)."""
    h = sums[0] if sums[0].dtype == torch.int64 else sums[0].to(torch.int64)
    for f in sums[1:]:
        h = torch.add(f, h, alpha=1000003)  # h is int64: f is promoted
    return h


def exact_flags(parts: list[Micro]) -> tuple[torch.Tensor, torch.Tensor]:
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


def exact(parts: list[Micro]) -> tuple[list[int], list[int]]:
    """(indices of the samples holding a NaN / Inf, indices of the tensors holding one), checked
    element by element: one host read. For a batch dropped with no step (`_keep_dropped`)."""
    bad, flags = exact_flags(parts)
    values: list[float] = torch.cat([bad, flags.to(bad.device)]).tolist()
    size = bad.numel()
    return ([i for i, v in enumerate(values[:size]) if v],
            [i for i, v in enumerate(values[size:]) if v])


def confirm(t: torch.Tensor, size: int, rows: list[int]) -> list[int]:
    """Those of `rows` of `t` (rows whose sums came back non-finite) that hold a NaN or Inf,
    element by element: one host read, on such a step only."""
    picked = t.reshape(size, -1)[rows]
    finite: list[bool] = torch.isfinite(picked).all(dim=1).tolist()
    return [r for r, ok in zip(rows, finite, strict=True) if not ok]


MASKS: dict[torch.device, torch.Tensor] = {}


def mask(device: torch.device) -> torch.Tensor:
    """`MASK` as a 0-dim int64 tensor on `device`, made once (a Python int operand is wrapped
    into a new tensor at every call). Filled on the device: `torch.tensor(..., device=cuda)`
    would copy from pageable host memory, a synchronizing call."""
    m = MASKS.get(device)
    if m is None:
        m = MASKS[device] = torch.full((), MASK, dtype=torch.int64, device=device)
    return m
