"""Pinpoint: find the op where the first non-finite value began, by replaying a step under an
op-level checker (a `TorchDispatchMode`), and attribute a spike without a NaN.

Public API (stable; the Guard and the zero-code runner build on it):

* `find_origin(run_step, *, model, optimizer=None, batch=None, step=None) -> Origin | None`
* `StepSnapshot.capture(model, optimizer)`, `.restore()`; `step_fingerprint(model, loss)`
* `replay_step(run_step, *, model, optimizer, snapshot, batch=None, fingerprint=None,
  step=None) -> Origin | None`
* `armed(step, *, model=None, rank=0)`: context manager yielding `Armed` (`.origin`)
* `spike_attribution(model, loss_fn, batch, ...) -> SpikeReport`
* `Origin.to_dict()`: the report.json `first_nonfinite` entry
"""

from nanguard.pinpoint.armed import Armed, armed
from nanguard.pinpoint.attribution import Attribution
from nanguard.pinpoint.checker import NonfiniteChecker
from nanguard.pinpoint.origin import PHASES, InputRange, Origin
from nanguard.pinpoint.replay import (
    StepSnapshot,
    find_origin,
    replay_step,
    run_checked,
    step_fingerprint,
)
from nanguard.pinpoint.spike import SpikeReport, spike_attribution

__all__ = [
    "PHASES",
    "Armed",
    "Attribution",
    "InputRange",
    "NonfiniteChecker",
    "Origin",
    "SpikeReport",
    "StepSnapshot",
    "armed",
    "find_origin",
    "replay_step",
    "run_checked",
    "spike_attribution",
    "step_fingerprint",
]
