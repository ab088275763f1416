"""One step's device-side values in named slots, read on the host in one go.

Every probe of a step (loss, gradient norms, activation abs-max, loaded-state flags, batch
fingerprints, the GradScaler's scale; after the update: parameter, optimizer-state and buffer
norms) adds its small device tensor under a name. `tensor()` concatenates them with one
`torch.cat` (type promotion makes the result float64 when any slot is: float64 holds every
fingerprint, below 2**52, exactly) and the host decodes the read list back by name with
`decode`, so no reader depends on where another probe's values sit.

On CUDA, `start_copy()` copies the packet into pinned host memory with `non_blocking=True` and
records an event; `values()` reads it once the event says the copy is complete. Under the
`observe` policy the guard starts the copy at the end of step t and reads it at step t+1, so
`optimizer.step()` never waits for the device. On the CPU the copy is the read itself.
"""

from __future__ import annotations

import torch


class Packet:
    """Named slots of one step's device statistics.

    Args:
        device: where the slots are gathered (the first parameter's device).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._parts: list[torch.Tensor] = []
        self._slots: dict[str, tuple[int, int]] = {}
        self._size = 0
        self._host: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def add(self, name: str, values: torch.Tensor) -> None:
        """Append `values` (any shape, any real dtype) as the slot `name`.

        Raises:
            AssertionError: `name` is already a slot of this packet (an internal error).
        """
        assert name not in self._slots, f"slot {name!r} added twice"
        flat = values if values.dim() == 1 else values.reshape(-1)  # probes hand detached values
        if flat.device != self.device:
            flat = flat.to(self.device)
        self._slots[name] = (self._size, flat.numel())
        self._size += flat.numel()
        self._parts.append(flat)

    def slot(self, name: str) -> torch.Tensor | None:
        """The device values of slot `name` (None when the packet has no such slot)."""
        if name not in self._slots:
            return None
        return self._parts[list(self._slots).index(name)]

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def __len__(self) -> int:
        return self._size

    def tensor(self) -> torch.Tensor:
        """Every slot in one float64 device tensor (one cat, at most one conversion)."""
        if not self._parts:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        out = self._parts[0] if len(self._parts) == 1 else torch.cat(self._parts)
        return out if out.dtype == torch.float64 else out.to(torch.float64)

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
        assert len(values) == self._size, (len(values), self._size)
        return {name: values[start : start + n] for name, (start, n) in self._slots.items()}
