"""A rolling window of the last N values of one signal with its mean and standard deviation in
O(1) per value: what the spike score's "rolling mean of the previous 1000 steps" needs.

Running sums of (x - shift) and (x - shift)^2 over a ring of the values. The shift (a recent
mean) keeps the sum of squares from cancelling catastrophically when the values are large
and their spread small (a loss of 2.3 +- 1e-4); a constant series gives a standard deviation
of exactly 0. The sums are recomputed exactly (math.fsum) once every N values, so rounding
drift from adding and removing values never accumulates: amortised O(1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


class Window:
    """The last `size` values pushed (finite floats only: the caller keeps non-finite ones
    out)."""

    __slots__ = ("_head", "_pushes", "_ring", "_s1", "_s2", "_shift", "size")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._ring: list[float] = []
        self._head = 0
        """Index of the oldest value once the ring is full."""
        self._shift = 0.0
        self._s1 = 0.0
        self._s2 = 0.0
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._ring)

    def push(self, x: float) -> None:
        """Add `x`, dropping the oldest value once `size` are held."""
        ring = self._ring
        if not ring:
            self._shift = x
        d = x - self._shift
        if len(ring) < self.size:
            ring.append(x)
        else:
            old = ring[self._head] - self._shift
            ring[self._head] = x
            self._head = (self._head + 1) % self.size
            self._s1 -= old
            self._s2 -= old * old
        self._s1 += d
        self._s2 += d * d
        self._pushes += 1
        if self._pushes % self.size == 0:
            self._exact()

    def extend(self, values: Iterable[float]) -> None:
        """Push every value, oldest first."""
        for v in values:
            self.push(float(v))

    def stats(self) -> tuple[float, float]:
        """Mean and population standard deviation (ddof 0) of the values held (at least one)."""
        n = len(self._ring)
        m1 = self._s1 / n
        var = self._s2 / n - m1 * m1
        return self._shift + m1, math.sqrt(var) if var > 0 else 0.0

    def values(self) -> list[float]:
        """The values held, oldest first."""
        return self._ring[self._head:] + self._ring[:self._head]

    def _exact(self) -> None:
        """Recompute the sums exactly, about the current mean."""
        ring = self._ring
        self._shift = math.fsum(ring) / len(ring)
        dev = [v - self._shift for v in ring]
        self._s1 = math.fsum(dev)
        self._s2 = math.fsum(d * d for d in dev)
