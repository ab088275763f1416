"""One step's device-side values in named slots, read on the host in one go.

Every probe of a step (loss, gradient norms, activation abs-max, loaded-state flags, batch
fingerprints and sums, the GradScaler's scale; after the update: parameter, optimizer-state and
buffer norms) adds its small device values under a name: a tensor, or a list of 0-dim tensors
(what `_foreach_norm` returns, one per tensor measured). `read_packets` reads one or more
packets (a step's pre- and post-update packets, or the steps buffered by `read_every`) with
one host read and as few ops as it can, because on a small model each tiny op's dispatch (a
few microseconds) is what a step pays. On a GPU every 0-dim value of the packets goes into ONE
`torch.stack`, and that stack and the packets' vectors are concatenated by ONE `torch.cat`
into a float64 tensor (`out=`: float64 holds every fingerprint, below 2**52, and every float32
norm exactly; no conversion of its own), copied to the host once. On the CPU the packet is
host memory already: its values are read where they are (`host_values`: `item()` for each
0-dim value, `tolist()` for each vector), with no stack and no cat to pay. The host decodes the
read list back by name with `decode`, so no reader depends on where another probe's values
sit.

On CUDA, `start_copy()` copies the packet into pinned host memory with `non_blocking=True` and
records an event; `host_tensor()` reads it once the event says the copy is complete. Under the
`observe` policy the guard starts the copy at the end of step t and reads it at step t+1, so
`optimizer.step()` never waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class Packet:
    """Named slots of one step's device statistics.

    Layout (what `decode` undoes): the 0-dim values of every slot first, in slot order, then the
    vector slots, in slot order.

    Args:
        device: where the slots are gathered (the first parameter's device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._scalars: list[torch.Tensor] = []
        self._vectors: list[torch.Tensor] = []
        self._slots: dict[str, tuple[bool, int, int, int]] = {}
        """name -> (held in `_scalars`, start within its kind's values, count, index of its
        first tensor in `_scalars` or `_vectors`)."""
        self._n_vector = 0
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def add(self, name: str, values: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Add `values` as the slot `name`: a tensor of any shape (a 0-dim one is one value), or
        a list of 0-dim tensors; any real dtype.

        Float32 0-dim values join the packet's one stack; other dtypes come as a vector of
        their own (a stack of mixed dtypes promotes, correct but ~4x slower on the CPU).

        Raises:
            AssertionError: `name` is already a slot of this packet (an internal error).
        """
        assert name not in self._slots, f"slot {name!r} added twice"
        if isinstance(values, torch.Tensor):
            if values.dim() or values.dtype != torch.float32:
                self._add_vector(name, values)
                return
            scalars: list[torch.Tensor] = [values]
        else:
            scalars = list(values)
            # The first tells (`_foreach_norm` gives one dtype); a mixed list still reads
            # right: the stack promotes.
            if not scalars or scalars[0].dtype != torch.float32:
                self._add_vector(name, torch.stack(scalars) if scalars else
                                 torch.zeros(0, device=self.device))
                return
        if scalars[0].device != self.device:
            scalars = [t.to(self.device) for t in scalars]
        self._slots[name] = (True, len(self._scalars), len(scalars), len(self._scalars))
        self._scalars += scalars

    def add_vectors(self, name: str, vectors: Sequence[torch.Tensor]) -> None:
        """Add several 1-D tensors as the one slot `name` (read back as their values one
        after the other): a probe with many small vectors pays one slot, not one each."""
        assert name not in self._slots, f"slot {name!r} added twice"
        start, k = self._n_vector, len(self._vectors)
        for v in vectors:
            if v.device != self.device:
                v = v.to(self.device)
            self._vectors.append(v)
            self._n_vector += v.numel()
        self._slots[name] = (False, start, self._n_vector - start, k)

    def _add_vector(self, name: str, values: torch.Tensor) -> None:
        flat = values if values.dim() == 1 else values.reshape(-1)  # probes hand detached values
        if flat.device != self.device:
            flat = flat.to(self.device)
        self._slots[name] = (False, self._n_vector, flat.numel(), len(self._vectors))
        self._n_vector += flat.numel()
        self._vectors.append(flat)

    def slot(self, name: str) -> torch.Tensor | None:
        """The device values of slot `name` as a 1-D tensor (None when there is no such slot)."""
        if name not in self._slots:
            return None
        scalar, start, n, k = self._slots[name]
        if scalar:
            return torch.stack(self._scalars[k : k + n])
        parts: list[torch.Tensor] = []
        seen = 0
        while seen < n or not parts:  # the vectors of an `add_vectors` slot, in order
            parts.append(self._vectors[k + len(parts)])
            seen += parts[-1].numel()
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return len(self._scalars) + self._n_vector

    def parts(self) -> list[torch.Tensor]:
        """The 1-D tensors whose concatenation is the packet (one stack of the 0-dim values)."""
        if not self._scalars:
            return list(self._vectors)
        return [torch.stack(self._scalars), *self._vectors]

    def tensor(self) -> torch.Tensor:
        """Every slot in one float64 device tensor (one stack, one cat)."""
        return _assemble([self])

    def read(self, read: Callable[[torch.Tensor | list[torch.Tensor]], list[float]]
             ) -> dict[str, list[float]]:
        """This packet alone, read with one call of `read` (see `read_packets`), by name."""
        return self.decode(read_packets([self], read)[0])

    def start_copy(self) -> None:
        """CUDA: start the copy to pinned host memory without waiting for it. No-op on the
        CPU (the device tensor is already host memory)."""
        if self.device.type != "cuda" or self._host is not None:
            return
        dev = self.tensor()
        self._host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        self._host.copy_(dev, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def host_tensor(self) -> torch.Tensor:
        """The packet on the host: the pinned copy once complete (waiting on its event, which a
        step later has long fired), else the device tensor itself."""
        if self._host is not None:
            assert self._event is not None
            self._event.synchronize()
            return self._host
        return self.tensor()

    def decode(self, values: list[float]) -> dict[str, list[float]]:
        """Split the host list of `tensor()` back into its slots, by name."""
        base = len(self._scalars)
        assert len(values) == base + self._n_vector, (len(values), len(self))
        return {name: values[start if scalar else base + start :
                             (start if scalar else base + start) + n]
                for name, (scalar, start, n, _) in self._slots.items()}


def _assemble(packets: Sequence[Packet]) -> torch.Tensor:
    """The device values of `packets` in one float64 tensor: every 0-dim value of every packet
    in one stack, then every vector, in one cat (`out=`: the float64 conversion comes free)."""
    scalars = [t for p in packets for t in p._scalars]
    parts = [torch.stack(scalars)] if scalars else []
    parts += [t for p in packets for t in p._vectors]
    if not parts:
        device = packets[0].device if packets else torch.device("cpu")
        return torch.zeros(0, dtype=torch.float64, device=device)
    if len(parts) == 1 and parts[0].dtype == torch.float64:
        return parts[0]
    out = torch.empty(sum(t.numel() for t in parts), dtype=torch.float64,
                      device=parts[0].device)
    return torch.cat(parts, out=out)


def host_values(t: torch.Tensor | Sequence[torch.Tensor]) -> list[float]:
    """A read's values as one Python list: a tensor's `tolist()`; for a list of CPU tensors
    (`_cpu_parts`), each 0-dim value's `item()` and each vector's `tolist()`, one after the
    other (integer tensors give exact Python ints)."""
    if isinstance(t, torch.Tensor):
        values: list[float] = t.tolist()
        return values
    values = []
    for part in t:
        if part.dim():
            values += part.tolist()
        else:
            values.append(part.item())
    return values


def _cpu_parts(packets: Sequence[Packet]) -> list[torch.Tensor]:
    """The CPU packets' values as tensors whose host values, one after the other, are
    `_assemble`'s layout: every 0-dim value, then each vector as it is. On the CPU a tensor
    already is host memory, so nothing is gathered first: no stack (`item()` on each 0-dim
    value takes half the time of a stack and its `tolist()`, at 5 values as at 400), no float64
    conversion and no cat (a cat of mixed dtypes into float64 costs ~30 us a step, as much as
    the rest of the read), and int64 fingerprints come back exact."""
    scalars: list[torch.Tensor] = []
    vectors: list[torch.Tensor] = []
    for p in packets:  # a loop, not comprehensions: no Python call each, on every read
        scalars += p._scalars
        vectors += p._vectors
    return scalars + vectors


def read_packets(packets: Sequence[Packet],
                 read: Callable[[torch.Tensor | list[torch.Tensor]], list[float]]
                 ) -> list[list[float]]:
    """Read `packets` with ONE call of `read` (the host read) and return each packet's values
    in its own layout (what its `decode` takes).

    On a GPU (acting policies) the packets are assembled together: one stack of all their
    0-dim values and one cat into float64, then one copy to the host. On the CPU, where there
    is no copy to make, `read` gets the 0-dim values and the vectors as they are
    (`_cpu_parts`).
    Packets already copied to pinned memory (`start_copy`, `observe` on a GPU) are read from
    their copies."""
    # Loops, not `any`/`all` of generators: no Python call per packet on every read.
    copied, on_cpu, vi = False, True, 0
    for p in packets:
        copied = copied or p._host is not None
        on_cpu = on_cpu and p.device.type == "cpu"
        vi += len(p._scalars)
    if copied:
        tensors = [p.host_tensor() for p in packets]
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            tensors = [t.cpu() for t in tensors]
        values = read(tensors[0] if len(tensors) == 1 else torch.cat(tensors))
        out, pos = [], 0
        for p in packets:
            out.append(values[pos : pos + len(p)])
            pos += len(p)
        return out
    values = read(_cpu_parts(packets)) if on_cpu else read(_assemble(packets))
    out, si = [], 0
    for p in packets:
        ns, nv = len(p._scalars), p._n_vector
        out.append(values[si : si + ns] + values[vi : vi + nv])
        si, vi = si + ns, vi + nv
    return out
