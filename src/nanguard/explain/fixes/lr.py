"""Which LRs an optimizer trains with, and the LR a fix proposes within them.

A growth measured on a run that blew up in its first updates says how far past the stable
limit the LR is, not where a good LR lies: taken literally it proposed `lr 1 -> 1e-06` for a
VAE under Adam (and 1e-19 from a larger blow-up), and `lr=1000 -> 100` for an Adam LR typed as
`1e3` instead of `1e-3`. So the proposal is bounded by what the optimizer is used with:

- an LR `TYPO` times its default or more whose exponent, sign flipped (1e3 -> 1e-3, 3e4 ->
  3e-4), lands in the optimizer's usual range is read as that typo;
- otherwise an LR above the optimizer's band is brought into the band (to the measured value
  when it lies there, else to the default or the band's edge), saying why;
- an LR at or below the band is cut by the measured factor, never more than `MAX_CUT`;
- an optimizer with no known range (a hand-written update) gets the measured LR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LrRange:
    """The LRs one optimizer is trained with."""

    default: float
    """torch.optim's default `lr` (tests/explain/test_fix_values.py checks it against torch)."""
    usual: tuple[float, float]
    """LRs people train it with: an LR typed with a flipped exponent sign lands here."""
    band: tuple[float, float]
    """Where a proposed LR lands (the range a practitioner starts a search from)."""


_ADAM = LrRange(1e-3, (1e-5, 1e-2), (1e-4, 1e-3))
_RANGES: dict[str, LrRange] = {
    "Adam": _ADAM,
    "AdamW": _ADAM,
    "RAdam": _ADAM,
    "SparseAdam": _ADAM,
    "NAdam": LrRange(2e-3, (1e-5, 1e-2), (1e-4, 2e-3)),
    "Adamax": LrRange(2e-3, (1e-5, 1e-2), (1e-4, 2e-3)),
    "SGD": LrRange(1e-3, (1e-3, 1.0), (1e-3, 1e-1)),
    "ASGD": LrRange(1e-2, (1e-3, 1.0), (1e-3, 1e-1)),
    "RMSprop": LrRange(1e-2, (1e-5, 1e-1), (1e-4, 1e-2)),
    "Rprop": LrRange(1e-2, (1e-4, 1e-1), (1e-3, 1e-2)),
    "Adagrad": LrRange(1e-2, (1e-4, 1.0), (1e-3, 1e-1)),
    "Adadelta": LrRange(1.0, (1e-2, 10.0), (0.1, 1.0)),
    "LBFGS": LrRange(1.0, (1e-2, 1.0), (0.1, 1.0)),
    "Muon": LrRange(1e-3, (1e-4, 1e-1), (1e-3, 2e-2)),
    "Lion": LrRange(1e-4, (1e-6, 1e-3), (1e-5, 1e-4)),
}

TYPO = 1e5
"""An LR this many times the optimizer's default is read as a typo when its exponent, sign
flipped, lands in the usual range (Adam's default 1e-3: lr >= 100)."""

MAX_CUT = 100.0
"""The deepest cut proposed for an LR already within (or below) the optimizer's band: a run
that still diverges at 1/100 of an ordinary LR has another cause."""


def lr_range(optimizer: str | None) -> LrRange | None:
    """The LRs `optimizer` (a class name, e.g. `AdamW`) trains with; None when unknown (a
    hand-written update, a class of the user's own)."""
    return _RANGES.get(optimizer or "")


def flip_exponent(lr: float) -> float | None:
    """`lr` with its decimal exponent's sign flipped (1000 -> 1e-3, 3e4 -> 3e-4), or None for
    an LR below 10 (no positive exponent to flip)."""
    if not math.isfinite(lr) or lr < 10:
        return None
    mantissa, exponent = f"{lr:.6e}".split("e")
    return float(f"{float(mantissa):g}e-{int(exponent)}")


def lr_typo(optimizer: str | None, lr: float | None) -> float | None:
    """The LR the user presumably meant when `lr` is `TYPO` times the optimizer's default or
    more and its exponent, sign flipped, lands in the optimizer's usual range; else None."""
    r = lr_range(optimizer)
    if r is None or lr is None or lr < TYPO * r.default:
        return None
    meant = flip_exponent(lr)
    if meant is None or not r.usual[0] <= meant <= r.usual[1]:
        return None
    return meant


def plausible_lr(optimizer: str | None, lr: float, measured: float, *,
                 on_this_model: bool = False) -> tuple[float, str]:
    """The LR to propose instead of `lr` (> 0), given the LR the run's own measurement implies
    (`measured` < `lr`), and why, when it is not `measured` (else an empty string).

    `on_this_model`: `measured` was measured on this model (the preflight's LR probe), not
    extrapolated from a growth; it is kept below the band, only capped above it. The result is
    always below `lr`."""
    r = lr_range(optimizer)
    name = optimizer or "the optimizer"
    if r is None:  # no range known (a hand-written update): the measurement alone
        return measured, ""
    lo, hi = r.band
    band = f"{name}'s usual LRs are {_sci(lo)} to {_sci(hi)}, default {_sci(r.default)}"
    if lr > hi:
        if measured > hi:
            return hi, (f"the measurement alone implies {measured:.3g}, still above the LRs "
                        f"{name} trains with ({band})")
        if measured >= lo or on_this_model:
            return measured, ""
        start = min(max(r.default, lo), hi)
        return start, (f"the growth measured implies {measured:.2g}, far below any LR {name} "
                       f"trains with ({band}): start from {_sci(start)}")
    if measured >= lr / MAX_CUT or on_this_model:
        return measured, ""
    return lr / MAX_CUT, (f"your lr={lr:g} is within or below {name}'s usual LRs ({_sci(lo)} "
                          f"to {_sci(hi)}); the growth implies {measured:.2g}, but a cut of "
                          f"more than {MAX_CUT:.0f}x is no LR fix: if lr={lr / MAX_CUT:.3g} "
                          "still diverges, look beyond the LR (the init, the data's scale)")


def _sci(v: float) -> str:
    """An LR as the optimizer's docs write it: `1e-4`, `2e-3`, `0.1`, `1`."""
    return f"{v:g}" if v >= 0.01 else f"{v:.0e}".replace("e-0", "e-")
