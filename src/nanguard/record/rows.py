"""One step's statistics as rows of the run store (a single transaction per step)."""

from __future__ import annotations

import hashlib

from nanguard.record.store import NullStore
from nanguard.watch.stats import StepStats


def batch_hash(samples: list[int]) -> str:
    """Fingerprint of a whole batch from its per-sample fingerprints."""
    return hashlib.blake2b(repr(samples).encode(), digest_size=8).hexdigest()


def write_step(store: NullStore, stats: StepStats, n_params: int, per_parameter: bool) -> None:
    """Write the step row, per-parameter stats, activations, batch fingerprints and alarms."""
    row = {
        "step": stats.step, "loss": stats.loss, "grad_norm": stats.grad_norm,
        "param_norm": stats.param_norm, "update_ratio": stats.update_ratio,
        "momentum_norm": stats.momentum_norm, "act_max": stats.act_max, "lr": stats.lr,
        "nonfinite": stats.nonfinite_signals(), "skipped": stats.skipped,
        "amp_scale": stats.amp_scale, "act_limit": stats.act_limit,
    }
    params = []
    if per_parameter:
        for i in range(n_params):
            state = {k: v[i] for k, v in stats.state_norms.items() if i in v}
            params.append((i, stats.grad_norms.get(i), stats.param_norms.get(i), state))
    batch = None
    if stats.sample_hashes:
        batch = (batch_hash(stats.sample_hashes), stats.sample_hashes, stats.nonfinite_samples)
    store.write_step(row, params=params, activations=stats.activations, batch=batch,
                     alarms=[a.to_dict() for a in stats.alarms])
