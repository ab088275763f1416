"""One step's statistics handed to the run store (the hot path: plain Python data only).

`write_step` runs inside the optimizer's step hooks, once per recorded step. It copies what the
store needs out of the `StepStats` (shallow copies of its dicts, so later changes to the stats
cannot reach the writer thread) and queues it; JSON encoding and SQL happen on the store's
writer thread (`record/writer.py`), except for steps that must be committed at once (see
`RunStore.write_step`).
"""

from __future__ import annotations

from nanguard.record.store import NullStore
from nanguard.record.writer import PerParam, batch_hash
from nanguard.watch.stats import HASHES_SLOT, StepStats

__all__ = ["SIGNALS", "batch_hash", "step_signals", "write_step"]

SIGNALS = ("loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm",
           "second_moment_norm", "act_max", "attn_logit_max", "lr", "amp_scale")
"""The per-step signals a step listener gets (those measured this step), with `nonfinite` and
`skipped` as 0/1."""


def step_signals(stats: StepStats) -> dict[str, float]:
    """The step's signals for live exporters and framework loggers (NaN and Inf kept)."""
    out = {k: float(v) for k in SIGNALS if (v := getattr(stats, k)) is not None}
    out["nonfinite"] = 1.0 if stats.nonfinite_signals() else 0.0
    out["skipped"] = 1.0 if stats.skipped else 0.0
    return out


def write_step(store: NullStore, stats: StepStats, n_params: int, per_parameter: bool,
               signals: list[str] | None = None) -> None:
    """Record the step row, per-parameter stats, activations, batch fingerprints and alarms.
    `signals`: the step's non-finite signals as the detectors sealed them (None:
    `stats.seal()` says)."""
    # As the detectors sealed them (an attribute: no call on the quiet step), else computed.
    grad_norm, param_norm, momentum_norm = stats.sealed_norms or stats.global_norms()
    row = {
        "step": stats.step, "loss": stats.loss, "grad_norm": grad_norm,
        # `update_ratio` and `act_max` asked only when measured (no call on most steps).
        "param_norm": param_norm,
        "update_ratio": stats.update_ratio if stats.update_norm is not None else None,
        "momentum_norm": momentum_norm,
        "act_max": stats.act_max if stats.activations else None, "lr": stats.lr,
        # As the detectors sealed them (a copy: no call); else scanned.
        "nonfinite": list(signals if signals is not None else stats.seal()),
        "skipped": stats.skipped,
        "amp_scale": stats.amp_scale, "act_limit": stats.act_limit,
        # (No call without optimizer state: plain SGD's quiet step stays as it was.)
        "second_moment_norm": stats.second_moment_norm if stats.state_norms else None,
        "attn_logit_max": stats.attn_logit_max, "clip_norm": stats.clip_norm,
    }
    per_param: PerParam | None = None
    if per_parameter and n_params:
        per_param = (n_params, stats.grad_norms.copy(), stats.param_norms.copy(),
                     dict(zip(stats.state_norms, map(dict.copy, stats.state_norms.values()),
                              strict=True)))
    batch = None
    # As the step holds them (still-raw sums: the writer thread combines them; no call).
    hashes = stats.__dict__.get(HASHES_SLOT)
    if hashes:  # the writer computes the batch's fingerprint
        batch = (None, hashes if isinstance(hashes, tuple) else list(hashes),
                 list(stats.nonfinite_samples))
    store.write_step(row, per_param=per_param,
                     activations=stats.activations.copy() if stats.activations else None,
                     batch=batch,
                     alarms=[a.to_dict() for a in stats.alarms] if stats.alarms else [])
