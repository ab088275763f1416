"""Rank agreement under torch.distributed: one small int32 all-reduce per decision.

Every rank computes its own verdict; `agree` reduces them so that all ranks take the same
action in the same step (none skips while another updates, none hangs waiting for a rank that
stopped). It uses MAX only (NCCL cannot reduce bool, and one collective is cheaper than two):
the lowest rank holding a non-finite value is encoded as `world - rank`, so MAX finds it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def active() -> bool:
    """True inside an initialized process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree(act: bool, nonfinite: bool, device: torch.device) -> tuple[bool, int | None]:
    """Reduce this rank's verdict with every other rank's.

    Args:
        act: this rank wants to act (skip / raise / rollback) on this step.
        nonfinite: this rank saw a non-finite value on this step.
        device: where the collective runs (the gradients' device; CPU for gloo).

    Returns:
        (whether any rank acts, the lowest rank that saw a non-finite value or None).
        Without a process group: this rank's own verdict.
    """
    if not active():
        return act, (rank() if nonfinite else None)
    world, me = dist.get_world_size(), dist.get_rank()
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    flags = torch.tensor([int(act), world - me if nonfinite else 0], dtype=torch.int32,
                         device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    any_act, bad = flags.tolist()
    return bool(any_act), (world - bad if bad else None)
