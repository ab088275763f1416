"""Where the first non-finite value showed, from the watched signals alone (no replay).

This is the cheap, always-on answer; an op-level replay (`nanguard.pinpoint`) refines phase,
module and op when the guard is given a `replay` function or a script is re-run armed.
"""

from __future__ import annotations

import math
from typing import Any

from nanguard.watch.stats import StepStats


def owner(param_name: str) -> str:
    """The module path that owns a parameter: `layers.3.weight` -> `layers.3`."""
    return param_name.rpartition(".")[0]


def locate(stats: StepStats, param_names: list[str], rank: int = 0, *,
           order: list[int] | None = None, buffer_names: list[str] | None = None
           ) -> dict[str, Any]:
    """The report.json `first_nonfinite` entry for the step `stats` describes.

    Args:
        order: each parameter's position in the model's module order (`named_parameters`);
            None takes the optimizer's order. Decides which parameter backward reached first.
        buffer_names: names of the model's floating-point buffers (`StepStats.buffer_norms`).
    """
    pos = order or list(range(len(param_names)))
    signals = stats.nonfinite_signals()
    phase, module = None, None
    samples = list(stats.nonfinite_samples or stats.dropped_samples)
    param: str | None = None
    if samples:
        phase = "data"
    elif "activation" in signals:
        phase = "forward"
        module = next(m for m, v in stats.activations.items() if not math.isfinite(v))
    elif "loss" in signals:
        phase = "loss"
    elif "grad" in signals:
        phase = "backward"
        # Backward runs from the output towards the input: the last parameter in module
        # order with a non-finite gradient is the earliest one to have received it.
        param = param_names[max(stats.nonfinite_grads, key=lambda i: pos[i])]
        module = owner(param)
    elif signals:
        phase = "optimizer"
        bad = [i for i, v in stats.param_norms.items() if not math.isfinite(v)]
        for norms in stats.state_norms.values():
            bad += [i for i, v in norms.items() if not math.isfinite(v)]
        param = param_names[min(bad, key=lambda i: pos[i])] if bad else None
        module = owner(param) if param else None
        if not bad and buffer_names:  # only a buffer (BatchNorm running stats) went bad
            name = next((buffer_names[i] for i, v in sorted(stats.buffer_norms.items())
                         if not math.isfinite(v)), None)
            module = owner(name) if name else None
            phase = "forward"  # running statistics are written by the forward pass
    return {"step": stats.step, "phase": phase, "module": module, "op": None, "source": None,
            "samples": samples, "rank": rank, "signals": signals, "param": param}
