"""Replica fingerprints and their comparison across ranks (what `watch.replicas`' check
computes and settles).

Fingerprint (what every device computes, bit for bit): each tensor's bytes read as 32-bit
integer words (elements of another width widened one by one when their byte count is odd or
unaligned) and summed modulo 2**32; the run's fingerprint is the per-tensor sums times odd
position weights, summed modulo 2**64. It is not a float norm: any single flipped bit changes
it (by +-2**b, never 0 modulo 2**32), as does any change that is not an exact permutation or
compensation within a tensor (a random one escapes with probability 2**-32).

Which rank is wrong: the ranks that disagree with the largest group of agreeing ranks; a tie
(two ranks) goes to the group holding the lowest rank, which DDP broadcast its parameters from.
"""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanguard.detect.alarm import Alarm

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NAMES_SHOWN = 5

def _word_sum(p: torch.Tensor) -> torch.Tensor:
    t = p.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    elif t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.element_size() != 4:
        try:  # 1-, 2- and 8-byte elements as 32-bit words (needs an even, aligned byte count)
            t = t.reshape(-1).view(torch.int32)
        except RuntimeError:  # an odd count or offset: widen each element (slower, rare)
            t = t.view(_INT_VIEW[t.element_size()]).to(torch.int32)
    # int32 with wrapping: the reduction CPUs vectorize (an int64 accumulator is ~10x slower).
    return t.view(torch.int32).sum(dtype=torch.int32)


def tensor_fingerprints(params: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor fingerprints (see the module docstring): an int64 vector on the parameters'
    device, one entry per tensor, each below 2**32 in magnitude."""
    if not params:
        return torch.zeros(0, dtype=torch.int64)
    return torch.stack([_word_sum(p) for p in params]).to(torch.int64)


def combine(fingerprints: torch.Tensor) -> torch.Tensor:
    """One int64 for the whole vector: position-weighted, so that a change in one tensor
    cannot cancel one in another by accident."""
    n = fingerprints.numel()
    weights = (torch.arange(n, dtype=torch.int64, device=fingerprints.device) * 2654435761
               + 97531) | 1  # fmt: skip
    return (fingerprints * weights).sum(dtype=torch.int64)


def layout_code(names: list[str], params: list[torch.Tensor]) -> int:
    """A stable 32-bit code of the parameters' names, shapes and dtypes (crc32: the same in
    every process, unlike `hash`). Ranks with different codes are not replicas."""
    text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in zip(names, params, strict=True))
    return zlib.crc32(text.encode())


@dataclass(kw_only=True)
class ReplicaDivergence:
    """Ranks whose parameters differ from the majority's after the update of `step`."""

    step: int
    ranks: list[int]
    """The ranks that disagree with the reference group."""
    reference: list[int]
    """The largest group of agreeing ranks (ties: the one holding the lowest rank)."""
    tensors: dict[int, list[str]] = field(default_factory=dict)
    """Per disagreeing rank, the parameters whose fingerprints differ from the reference's."""
    before_update: bool = False
    """Seen before the update of `step` (the check before the first update), not after it."""

    def message(self) -> str:
        parts = []
        for r in self.ranks:
            names = self.tensors.get(r, [])
            shown = ", ".join(names[:_NAMES_SHOWN])
            more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
            parts.append(f"rank {r} in {shown}{more}")
        ref = ", ".join(map(str, self.reference))
        return (
            f"parameters differ bit for bit between replicas "
            f"{'before the update of' if self.before_update else 'after'} step {self.step}: "
            f"{'; '.join(parts)} (reference: rank(s) {ref})"
        )

    def alarm(self) -> Alarm:
        return Alarm(
            step=self.step,
            kind="replica_divergence",
            signal="param_fingerprint",
            value=float(len(self.ranks)),
            message=self.message(),
        )


def _gather(vector: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(vector) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vector)
    return out


def fingerprint_head(names: list[str], params: list[torch.Tensor], device: torch.device
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the per-tensor fingerprints, the head the ranks compare: [combined fingerprint,
    number of tensors, layout code], int64 on `device`)."""
    per_tensor = tensor_fingerprints(params).to(device)
    head = torch.stack(
        [
            combine(per_tensor),
            torch.tensor(len(params), device=device),
            torch.tensor(layout_code(names, params), device=device),
        ]
    )
    return per_tensor, head


def settle(step: int, names: list[str], per_tensor: torch.Tensor, rows: list[list[int]]
           ) -> ReplicaDivergence | None:
    """The verdict from every rank's head (row r: rank r's). A collective on a mismatch (the
    per-tensor all_gather): every rank calls it with the same rows at the same point.

    Raises:
        ValueError: the ranks hold different parameter layouts (not data-parallel replicas).
    """
    if len({tuple(row[1:]) for row in rows}) > 1:
        raise ValueError(
            "ranks hold different parameters (names, shapes or dtypes): not data-parallel replicas"
        )
    totals = [row[0] for row in rows]
    if len(set(totals)) == 1:
        return None
    counts = Counter(totals)
    ref_total = max(counts, key=lambda v: (counts[v], -totals.index(v)))
    reference = [r for r, v in enumerate(totals) if v == ref_total]
    ranks = [r for r, v in enumerate(totals) if v != ref_total]
    # Everyone saw the same totals, so everyone makes this second call, or nobody does.
    table = _gather(per_tensor)
    ref_row = table[reference[0]]
    tensors = {
        r: [names[i] for i in torch.nonzero(table[r] != ref_row).flatten().tolist()] for r in ranks
    }
    return ReplicaDivergence(step=step, ranks=ranks, reference=reference, tensors=tensors)


def device_of(params: list[torch.Tensor]) -> torch.device:
    if dist.get_backend() == "gloo" or not params:
        return torch.device("cpu")
    return params[0].device


def compare(step: int, names: list[str], params: list[torch.Tensor]) -> ReplicaDivergence | None:
    """Compare this rank's parameters with every other rank's. A collective: every rank of the
    default group must call it at the same point of the same step.

    Returns:
        The divergence (the same on every rank), or None when all ranks agree.

    Raises:
        ValueError: the ranks hold different parameter layouts (not data-parallel replicas).
    """
    per_tensor, head = fingerprint_head(names, params, device_of(params))
    return settle(step, names, per_tensor, [t.tolist() for t in _gather(head)])
