"""Rank agreement under torch.distributed: one small int32 all-reduce per decision.

Every rank computes its own verdict; `agree` reduces them so that all ranks take the same
action in the same step (none skips while another updates, none hangs waiting for a rank that
stopped). It uses MAX only (NCCL cannot reduce bool, and one collective is cheaper than two). Which
rank the value came from: under DDP every rank's gradients go non-finite together once one rank
fed a NaN into the all-reduce, so "the lowest rank with a NaN" would name rank 0. The verdict
therefore carries the phase where each rank saw it (data < forward < loss < backward <
optimizer) and MAX picks the earliest phase, then the lowest rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def active() -> bool:
    """True inside an initialized process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


PHASE_ORDER = ("data", "forward", "loss", "backward", "optimizer")


def agree(act: bool, nonfinite_phase: str | None, device: torch.device) -> tuple[bool, int | None]:
    """Reduce this rank's verdict with every other rank's.

    Args:
        act: this rank wants to act (skip / raise / rollback) on this step.
        nonfinite_phase: where this rank saw a non-finite value on this step (a name from
            PHASE_ORDER, "" if unknown), or None when it saw none.
        device: where the collective runs (the gradients' device; CPU for gloo).

    Returns:
        (whether any rank acts, the rank where the value showed first — earliest phase, then
        lowest rank — or None).
        Without a process group: this rank's own verdict.
    """
    if not active():
        return act, (rank() if nonfinite_phase is not None else None)
    world, me = dist.get_world_size(), dist.get_rank()
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    score = 0
    if nonfinite_phase is not None:
        order = PHASE_ORDER.index(nonfinite_phase) if nonfinite_phase in PHASE_ORDER else 3
        score = (len(PHASE_ORDER) - order) * world + (world - me)
    flags = torch.tensor([int(act), score], dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_act, best = flags.tolist()
    if not best:
        return bool(any_act), None
    # best % world == (world - rank) % world: 0 for rank 0, else world - rank.
    return bool(any_act), (world - best % world) % world
