"""Gather the diagnosis evidence from a live Guard (optimizer settings, healthy history)."""

from __future__ import annotations

import math
from statistics import median
from typing import TYPE_CHECKING, Any

from nanguard.detect.detectors import SpikeDetector
from nanguard.explain.evidence import Evidence

if TYPE_CHECKING:
    from nanguard.guard import Guard


def evidence_from_guard(guard: Guard) -> Evidence:
    """Evidence for `diagnose` from what the guard saw and how the optimizer is set up.

    Optional guard attributes set by other parts (read with a default, never required):
    `run_entry` (`"run"` when `nanguard run` made the guard, else `"api"`), `script_clip`
    (the `max_norm` of the script's own gradient clipping, 0 when it is off) and `preflight`
    (the verdict of `nanguard run --preflight`, a dict; used only when it ran).
    """
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
        # `nanguard run`'s stand-in for hand-written updates is no optimizer the user knows.
        optimizer=("your hand-written update" if type(guard.optimizer).__name__ == "ManualStep"
                   else type(guard.optimizer).__name__),
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
        history=[_step_record(s) for s in getattr(guard, "history", [])],
        clip=_float_or_none(getattr(guard, "script_clip", None)),
        entry=str(getattr(guard, "run_entry", "api") or "api"),
        preflight=_preflight(getattr(guard, "preflight", None)),
    )


def _step_record(stats: Any) -> dict[str, Any]:
    """The magnitudes of one recorded step a rule may read (see `Evidence.history`)."""
    acts = [v for v in (getattr(stats, "activations", None) or {}).values() if math.isfinite(v)]
    return {
        "step": stats.step,
        "loss": stats.loss,
        "grad_norm": stats.grad_norm if stats.grad_norms else None,
        "act_max": max(acts) if acts else None,
        "lr": stats.lr,
    }


def _preflight(v: object) -> dict[str, Any] | None:
    return v if isinstance(v, dict) and v.get("ran") else None


def _float_or_none(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
