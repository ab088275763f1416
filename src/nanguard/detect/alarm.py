"""The alarm record shared by detectors, policies, the run store and report.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ALARM_KINDS = (
    "nonfinite",  # a NaN/Inf in loss, gradients, parameters, optimizer state or activations
    "overflow",  # a float32 norm overflowed although every element is finite
    "spike",  # the grad norm jumped far above its recent history
    "cascade",  # several consecutive steps of multiplicative growth
    "forecast",  # extrapolated growth reaches the dtype's largest value within a few steps
    "divergence",  # the loss climbs far above its recent level
    "vanishing",  # gradients vanish against the parameters for many steps
    "amp_collapse",  # the GradScaler's scale keeps backing off: fp16 overflows at any scale
    "saturation",  # a sigmoid/softmax probability a log consumes is about to round to 0 or 1
    # (a warning from a sampled probe, nanguard.watch.saturation: recorded, never acted on)
    "replica_divergence",  # data-parallel replicas' parameters differ bit for bit
    # (nanguard.watch.replicas, every DetectConfig.replica_every steps: recorded, never acted on)
    "checkpoint_mismatch",  # a loaded checkpoint differs from the manifest of its save
    "rerun_mismatch",  # a sampled quiet step re-ran differently (`DetectConfig.rerun_every`)
    "eval_nonfinite",  # a metric an evaluation pass logged is NaN/Inf (detect.eval_metrics)
    "buffer_nonfinite",  # a buffer training does not read (BatchNorm running statistics in
    # training mode) went NaN/Inf: evaluation will read it (nanguard.watch.unread; a warning)
    # (nanguard.watch.loads, under `nanguard run`: recorded, never acted on)
    "lr_jump",  # the LR went up >= 3x in one step, a resume's first step included
    # (nanguard.policy.lr_change: recorded, never acted on; `heal` ramps the LR back up)
    "lr_jump_loss",  # the loss after an LR jump far above the loss before it
    "resume_loss",  # the loss right after a resume is far above the loss recorded at save
    # (nanguard.recover.loss_after: recorded, never acted on)
)
ACT_ON_KINDS = ("nonfinite", "overflow", "spike", "cascade", "forecast", "divergence",
                "vanishing", "amp_collapse")
"""The kinds a policy can act on: the valid names for `GuardConfig.act_on` (the others are
recorded, never acted on)."""
assert set(ACT_ON_KINDS) <= set(ALARM_KINDS)


@dataclass(kw_only=True)
class Alarm:
    """One warning. Keys match `report.json` `alarms` entries."""

    step: int
    """0-based index of the training step (optimizer steps completed before it)."""
    kind: str
    """One of ALARM_KINDS."""
    signal: str
    """What was measured: `loss`, `grad_norm`, `act_max`, `momentum_norm`, `grad`, ..."""
    value: float
    """The value that raised it (for a forecast: the steps left)."""
    message: str
    """One line a user can read."""
    cause: str | None = None
    """What drove it where the evidence names it (`bad_batch`: `detect.bad_batch`); absent
    from report.json otherwise."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["cause"] is None:
            del d["cause"]
        return d
