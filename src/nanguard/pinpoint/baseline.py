"""Each parameter's typical gradient norm on healthy steps: what a spike's layers are measured
against (`pinpoint.spike`, through `pinpoint.live.explain_spike`).

The baseline is an exponential moving average per parameter index, `0.9 * prev + 0.1 * v` over
the gradient norms of every step with no alarm and no non-finite value (a parameter's first
such norm starts it). It is read only when a spike is explained and when the guard's state is
saved, so it is kept lazily: each healthy step hands its norms over (`GradBaseline.pending`)
and they are folded in, in step order, when the baseline is read (`values`) or every `FOLD_AT`
steps. A run of steps with the same parameters is folded with NumPy vectors: the same IEEE
multiplications and addition, element by element and in the same order, so every value is
bit for bit what the per-step update gives (`tests/perf/test_grad_baseline.py`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["GradBaseline"]

_VECTOR_MIN = 16
"""Fewer parameters than this fold as Python floats (NumPy's per-call cost would be more)."""


class GradBaseline:
    """The per-parameter EMA of healthy gradient norms (see the module docstring).

    Args:
        values: a saved baseline (`values()` of another guard), or None for an empty one.
    """

    FOLD_AT = 64
    """Pending steps that trigger a fold (bounds what `pending` holds)."""

    def __init__(self, values: dict[int, float] | None = None) -> None:
        self._base: dict[int, float] = dict(values or {})
        self.pending: list[dict[int, float]] = []
        """Healthy steps' gradient norms (index -> norm), oldest first, not folded yet. The
        guard appends a step's `grad_norms` itself (no call on the quiet step); the dicts are
        not changed after the step is recorded."""

    def values(self) -> dict[int, float]:
        """The baseline now: every pending step folded in."""
        if self.pending:
            self.fold()
        return self._base

    def fold(self) -> None:
        """Fold the pending steps into the baseline, oldest first."""
        pending, self.pending = self.pending, []
        base = self._base
        i, n = 0, len(pending)
        while i < n:
            d = pending[i]
            keys = tuple(d)
            j = i + 1
            if len(keys) >= _VECTOR_MIN and all(k in base for k in keys):
                while j < n and tuple(pending[j]) == keys:
                    j += 1
            if j - i < 2:  # one step, few parameters, or a parameter's first norm
                for k, v in d.items():  # a loop: no comprehension call per step
                    prev = base.get(k)
                    base[k] = v if prev is None else 0.9 * prev + 0.1 * v
                i += 1
                continue
            b = np.array([base[k] for k in keys], dtype=np.float64)
            rows = np.array([list(p.values()) for p in pending[i:j]], dtype=np.float64)
            for r in rows:
                b = 0.9 * b + 0.1 * r
            base.update(zip(keys, b.tolist(), strict=True))
            i = j
