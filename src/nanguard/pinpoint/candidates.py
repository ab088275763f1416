"""The op checker's bookkeeping (pinpoint/checker.py): which tensors hold a non-finite value,
with what label, and which candidate for the origin each one carries.

A tracked tensor is known by identity (its `id` and a weak reference, so that a freed
tensor's id reused by a new one is not mistaken for it) and labelled either **intended** (made
non-finite on purpose: a mask's `-inf`) or **tainted** by candidate `k`, the k-th op that made a
non-finite value from finite or intended inputs. Candidates are kept in the order they opened:
the earliest one that is confirmed, or still alive at the end, is the origin.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from nanguard.pinpoint.origin import Origin, all_finite

INTENDED = -1
"""`Candidates.label` of a tensor made non-finite on purpose."""


@dataclass(kw_only=True)
class Candidate:
    """One op (or input) that may be where the first non-finite value began."""

    origin: Origin
    refs: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    """The tensors that carried its value (some may be freed or overwritten since)."""
    confirmed: bool = False
    """Its value flowed on: a later op that read it made a non-finite output."""
    absorbed: bool = False
    """Read by a later op whose outputs were finite (and not healed in place)."""
    healed: bool = False
    """Overwritten in place with finite values."""
    persists: bool = True
    """Counts as the origin if still alive and non-finite at the end (not for the batch)."""


class Candidates:
    """The candidates of one checker and the labels of the tensors it tracks."""

    def __init__(self) -> None:
        self._cands: list[Candidate] = []
        self._taint: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._intended: dict[int, weakref.ref[torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._cands)

    def __getitem__(self, k: int) -> Candidate:
        return self._cands[k]

    # ------------------------------------------------------------------ labels

    def label(self, t: torch.Tensor) -> int | None:
        """`INTENDED`, a candidate index for a tainted tensor, or None when untracked."""
        hit = self._taint.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        ref = self._intended.get(id(t))
        return INTENDED if ref is not None and ref() is t else None

    def known(self, t: torch.Tensor) -> bool:
        """Whether `t` is tracked at all (intended or tainted)."""
        return self.label(t) is not None

    def mark_intended(self, outs: list[torch.Tensor]) -> None:
        """The non-finite tensors of `outs` were made on purpose: never an origin."""
        for t in outs:
            if not all_finite([t]):
                self._taint.pop(id(t), None)
                self._intended[id(t)] = weakref.ref(t)

    def forget_intended(self, t: torch.Tensor) -> None:
        """`t` is no longer an intended value (overwritten, or found to have overflowed)."""
        self._intended.pop(id(t), None)

    def taint(self, t: torch.Tensor, k: int) -> None:
        """Label `t` as carrying candidate `k`'s value (it does not count towards `k`'s end)."""
        self._taint[id(t)] = (weakref.ref(t), k)

    def carry(self, tensors: list[torch.Tensor], k: int) -> None:
        """`tensors` carry candidate `k`'s value on: labelled, and watched at the end."""
        for t in tensors:
            self.taint(t, k)
            self._cands[k].refs.append(weakref.ref(t))

    def overwritten(self, targets: list[torch.Tensor]) -> None:
        """In-place targets written with finite values: no longer tracked, and a candidate
        whose value they held is healed."""
        for t in targets:
            hit = self._taint.pop(id(t), None)
            if hit is not None and hit[0]() is t:
                self._cands[hit[1]].healed = True
            self._intended.pop(id(t), None)

    # ------------------------------------------------------------------ candidates

    def open(self, origin: Origin, tensors: list[torch.Tensor], persists: bool = True) -> int:
        """A new candidate held by `tensors`; returns its index."""
        k = len(self._cands)
        self._cands.append(Candidate(origin=origin, persists=persists))
        self.carry(tensors, k)
        return k

    def index_of(self, origin: Origin) -> int | None:
        """The index of the candidate of `origin`, or None."""
        return next((i for i, c in enumerate(self._cands) if c.origin is origin), None)

    def tensors_of(self, origin: Origin) -> list[torch.Tensor]:
        """The live tensors that carried `origin`'s value."""
        return [t for c in self._cands if c.origin is origin for r in c.refs
                if (t := r()) is not None]

    def absorb(self, tensors: list[torch.Tensor], target_ids: set[int]) -> None:
        """An op read `tensors` and gave finite outputs: the candidates they carried are
        absorbed (in-place targets, in `target_ids`, are not read but written)."""
        for t in tensors:
            if id(t) in target_ids:
                continue
            k = self.label(t)
            if k is not None and k >= 0:
                self._cands[k].absorbed = True

    def absorbed_before(self, k: int) -> int | None:
        """An earlier absorbed candidate made on the forward line that created the backward
        node candidate `k` runs for: the value that caused candidate `k`."""
        o = self._cands[k].origin
        if o.phase != "backward" or o.source is None:
            return None
        for j in range(k):
            c = self._cands[j]
            if (c.absorbed and not c.healed and not c.confirmed and c.origin.kind == "op"
                    and c.origin.source == o.source):
                return j
        return None

    def alive(self, k: int, *, recheck: bool) -> bool:
        """Whether a tensor still labelled with candidate `k` lives (and, with `recheck`, is
        still non-finite: one host read per tensor, at the end only)."""
        for ref in self._cands[k].refs:
            t = ref()
            if t is None or self._taint.get(id(t), (None, -2))[1] != k:
                continue
            if not recheck or not all_finite([t]):
                return True
        return False

    def settled(self) -> Origin | None:
        """The origin once no earlier candidate can still take its place: the earliest
        confirmed one with no live candidate before it; None while undecided."""
        for k, c in enumerate(self._cands):
            if c.confirmed:
                return c.origin
            if self.alive(k, recheck=False):
                return None
        return None

    def final(self) -> Origin | None:
        """The origin at the end of the run: the earliest candidate confirmed or still alive
        and non-finite (or the absorbed forward value that caused it), else the earliest
        absorbed op."""
        for k, c in enumerate(self._cands):
            if c.confirmed or (c.persists and self.alive(k, recheck=True)):
                j = None if c.confirmed else self.absorbed_before(k)
                if j is not None:
                    self._cands[j].origin.propagated_by = {
                        "op": c.origin.op, "phase": c.origin.phase,
                        "module": c.origin.module, "node": c.origin.node}
                return (c if j is None else self._cands[j]).origin
        absorbed = [c for c in self._cands if c.absorbed and not c.healed
                    and c.origin.kind == "op"]
        return absorbed[0].origin if absorbed else None
