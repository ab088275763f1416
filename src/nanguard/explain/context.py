"""Gather the diagnosis evidence from a live Guard (optimizer settings, healthy history)."""

from __future__ import annotations

from statistics import median
from typing import TYPE_CHECKING

from nanguard.detect.detectors import SpikeDetector
from nanguard.explain.evidence import Evidence

if TYPE_CHECKING:
    from nanguard.guard import Guard


def evidence_from_guard(guard: Guard) -> Evidence:
    """Evidence for `diagnose` from what the guard saw and how the optimizer is set up."""
    group = guard.optimizer.param_groups[0] if guard.optimizer.param_groups else {}
    momentum = group.get("momentum")
    if momentum is None and isinstance(group.get("betas"), (tuple, list)):
        momentum = group["betas"][0]
    healthy = None
    for d in guard.detectors:
        if isinstance(d, SpikeDetector) and d.history["grad_norm"]:
            healthy = 10 ** median(d.history["grad_norm"])
    dtypes = {str(p.dtype) for p in guard.params}
    failing = guard.failing_stats
    return Evidence(
        first_nonfinite=guard.first_nonfinite,
        alarms=[a.to_dict() for a in guard.alarms],
        optimizer=type(guard.optimizer).__name__,
        # The LR of the failing step (a scheduler may have moved it since), else the current.
        lr=(failing.lr if failing is not None and failing.lr is not None
            else float(group["lr"]) if isinstance(group.get("lr"), (int, float)) else None),
        momentum=float(momentum) if isinstance(momentum, (int, float)) else None,
        eps=float(group["eps"]) if isinstance(group.get("eps"), (int, float)) else None,
        # The dtype the origin op computed in (autocast!), else the parameters' one.
        dtype=((guard.first_nonfinite or {}).get("output") or {}).get("dtype")
        or (dtypes.pop() if len(dtypes) == 1 else None),
        healthy_grad_norm=healthy,
        bad_tensors=list(failing.nonfinite_tensors) if failing else [],
        n_batch_tensors=failing.batch_tensors if failing else 0,
        reproduced=(guard.first_nonfinite or {}).get("reproduced"),
        lead_window=guard.config.detect.lead_window,
    )
