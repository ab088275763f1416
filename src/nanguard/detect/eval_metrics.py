"""Evaluation metrics that went non-finite: the NaN a validation loop logs and a logger drops.

An evaluation pass never reaches an update, so the step detectors never see it; a framework
adapter hands the metrics an evaluation produced (Lightning's `validation_step` logs, the
Trainer's `evaluate` metrics) to `eval_alarms` when the evaluation ends. Each metric is said
once, the first time it is non-finite: a validation set with a NaN row is one line, not one
per epoch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from nanguard.detect.alarm import Alarm

__all__ = ["eval_alarms"]


def _scalar(v: Any) -> float | None:
    """A metric's value as a float when it is one number (a float, a 1-element tensor)."""
    numel = getattr(v, "numel", None)
    if numel is not None:
        if numel() != 1:
            return None
        v = v.detach().float().item()  # one host read per metric, once per evaluation
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def eval_alarms(metrics: Mapping[str, Any], step: int, seen: set[str], *,
                keys: Iterable[str] | None = None) -> list[Alarm]:
    """`eval_nonfinite` alarms for the metrics of `metrics` (only `keys`, when given) that
    are NaN/Inf and not in `seen` (updated: each metric is said once). Runs when an evaluation
    ends, off the training step."""
    out: list[Alarm] = []
    for key in metrics if keys is None else keys:
        value = _scalar(metrics.get(key))
        if value is None or math.isfinite(value) or key in seen:
            continue
        seen.add(key)
        out.append(Alarm(
            step=step, kind="eval_nonfinite", signal=f"metric:{key}", value=value,
            message=f"evaluation metric {key!r} is {value} at step {step}: the evaluation "
                    "read a NaN/Inf (an eval batch, or weights fine for training but not for "
                    "this data); training's own values are watched separately"))
    return out
