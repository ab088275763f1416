"""Is this spike a bad batch? The cause of a spike, from what the spike detector already saw.

A batch is bad (a corrupted region of the data, rows of the wrong encoding, a repeated
symbol) when its *own* loss is an outlier: the loss of a step is computed by the forward of
that step's batch with the parameters the previous update left, before this step's update.
If that loss is far above its recent level while

- the steps before were quiet (no spike in the last `QUIET_STEPS`, the step before's grad
  norm under 3x its recent level: the update that made the parameters which computed this
  loss was an ordinary one), and
- the LR is the one of the step before (within `_LR_STEADY`: a schedule's slow drift, not a
  jump, a restart or a resume without warm-up, which are causes of their own),

then nothing in the model or the optimizer changed between a healthy step and this one but the
batch: the batch is the cause. The fix is about that batch (discard or clip its update, name
it and its rows), never the LR or the weight decay.

A gradient spike whose batch's loss stays at its level is not called a bad batch on that
evidence: it is also the signature of an unstable optimizer (the update of the step before
pushed the weights to where any batch's gradient is large; its loss spike comes one step
later), which `heal` corrects. It is one when, under the same quiet-step and steady-LR
conditions, the spike's replay shows a few rows carrying the gradient far above the others
(`by_rows`): a row of one repeated symbol has an ordinary loss and a huge gradient.

The converse is evidence too: a spike whose replay measured every row of its batch before the
update and found none standing out was not made by its batch (`ruled_out`): the policies do
not discard its update (`policy.recurrence`).

`judge` runs only on a step where the spike detector fired: the quiet step pays nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BAD_BATCH = "bad_batch"
"""The cause named on a spike alarm (`Alarm.cause`) and its report.json `spikes` entry."""

_LR_STEADY = 0.1
"""An LR within this share of the previous step's counts as unchanged (a cosine schedule
moves it by far less per step; a warm-up's first steps or a 10x jump by far more)."""


QUIET_STEPS = 5
"""Steps before a spike that must hold no spike (of either signal) for its batch to be named
its cause. One quiet step inside a run of spikes is no evidence: in nanoGPT's resumed run at
20x (seed 0) the loss sat 1.5-1.8x its level for 400 iterations, iteration 795's dipped under
the spike threshold, and 796 was named a bad batch (its skip left the run worse than plain).
Bad batches come apart: the planted ones of tests/programs 8 steps or more."""


_PRECURSOR = 3.0
"""A grad norm this many times its recent level on the step before is a precursor that may
have made this step's loss (heal's own precursor ratio, `HealConfig.ratio`); below it, small
batches' gradients jump 1.5-2x too often to rule the batch out."""


ROW_Z = 10.0
"""How far (robust sigma over the batch's rows) a row's own gradient norm must stand out for a
grad-norm spike to be named a bad batch on its rows alone (`by_rows`): repeated-symbol rows
stand at 17-22 (nanoGPT, a tiny char GRU); the replay names a row at 3.5."""


@dataclass(frozen=True)
class LossOutlier:
    """The step's loss against its recent level (`SpikeDetector`'s loss test)."""

    loss: float
    level: float
    z: float


def judge(step: int, outlier: LossOutlier | None, *, lr: float | None, last_lr: float | None,
          last_spike: int | None, before_jump: float | None = None,
          prev_lr: float | None = None) -> str | None:
    """Why the spike at `step` happened, as a sentence, when the batch is the cause; None when
    the evidence does not rule the model and the optimizer out (see the module docstring).

    Args:
        step: the spiking step.
        outlier: the batch's own loss when it is an outlier (a loss spike on this step), else
            None.
        lr: the step's LR; `last_lr`: the LR of the step the detector saw before it (the
            update that made the parameters this loss was computed with); `prev_lr`: the
            LR of the step before that one.
        last_spike: the step of the spike before this one (either signal), if any.
        before_jump: the step before's grad norm over its recent level (None: unknown); at
            `_PRECURSOR` or more, that step's update may have made this loss (an unstable
            optimizer's precursor that raised no alarm).
    """
    if outlier is None:
        return None
    lr_note = steady(step, lr=lr, last_lr=last_lr, prev_lr=prev_lr, last_spike=last_spike,
                     before_jump=before_jump)
    if lr_note is None:
        return None
    return (f"a bad batch: its own loss {outlier.loss:.4g} is {outlier.loss / outlier.level:.3g}x "
            f"its recent level {outlier.level:.4g} ({outlier.z:.0f} sigma) before its update, "
            f"after a quiet step, {lr_note}: the data, not the model or the optimizer")


def steady(step: int, *, lr: float | None, last_lr: float | None, prev_lr: float | None,
           last_spike: int | None, before_jump: float | None) -> str | None:
    """Whether nothing but the batch changed between a quiet step and `step` (`judge`'s
    arguments): a note on the LR ("LR unchanged (0.003)") when so, else None."""
    if last_spike is not None and last_spike >= step - QUIET_STEPS:
        return None  # the parameters that computed this loss came from a run of spikes
    if before_jump is not None and before_jump >= _PRECURSOR:
        return None  # ...or from a step whose gradient had already jumped
    if (last_lr is not None and prev_lr is not None and prev_lr > 0 and math.isfinite(last_lr)
            and abs(last_lr / prev_lr - 1.0) > _LR_STEADY):
        return None  # the update that made the parameters of this loss ran at a new LR
    if lr is not None and last_lr is not None and last_lr > 0 and math.isfinite(lr):
        if abs(lr / last_lr - 1.0) > _LR_STEADY:
            return None  # the LR moved: a cause of its own
        return f"LR unchanged ({lr:.3g})"
    return "no LR change seen"


def by_rows(found: dict[str, Any], lr_note: str) -> str | None:
    """A grad-norm spike whose batch's loss stayed at its level, after a quiet step at a
    steady LR (`lr_note`, from `steady`): a bad batch when the replay (`found`, from
    `pinpoint.live.explain_spike`) shows a few rows carrying its gradient, each `ROW_Z` or more
    robust sigma above the batch's other rows (a row of one repeated symbol: its loss is no
    outlier, its gradient is), or rows whose own loss stands `ROW_Z` or more robust sigma
    above the loss's recent level (the clean rows' spread below it: however many rows are
    corrupted, while their mean stays under the batch-loss test, as 6 rows of 10 of a new
    word do). An unstable optimizer raises every row's gradient together and leaves no row's
    loss far out: no row stands out. The sentence for the alarm, or None."""
    rows = [d for d in found.get("samples") or [] if float(d.get("z", 0.0)) >= ROW_Z]
    if rows:
        z = min(float(d["z"]) for d in rows)
        names = ", ".join(str(d["index"]) for d in rows)
        return (f"a bad batch: row(s) {names} carry its gradient ({z:.0f} sigma or more above "
                f"the batch's other rows, replayed before its update), after a quiet step, "
                f"{lr_note}: the data, not the model or the optimizer")
    rows = [d for d in found.get("loss_samples") or [] if float(d.get("z", 0.0)) >= ROW_Z]
    if not rows:
        return None
    z = min(float(d["z"]) for d in rows)
    names = ", ".join(str(d["index"]) for d in sorted(rows, key=lambda d: int(d["index"])))
    return (f"a bad batch: row(s) {names} have a loss {z:.0f} sigma or more above the loss's "
            f"recent level (replayed before its update), after a quiet step, {lr_note}: the "
            "data, not the model or the optimizer")


def batch_fingerprint(hashes: list[int]) -> str | None:
    """One 52-bit fingerprint of a whole batch from its samples' (order-independent: the same
    rows in another order are the same batch), as 13 hex digits; None for an unseen batch."""
    if not hashes:
        return None
    acc = 0
    for h in hashes:
        acc = (acc + (h * 0x9E3779B97F4A7C15 >> 12)) & ((1 << 52) - 1)
    return f"{acc:013x}"


def actionable(alarm: Any) -> bool:
    """Whether a policy may act on `alarm` for what it is: a loss spike acts only when its
    batch is the cause. Otherwise the loss spiked because the step before's update moved the
    weights (an unstable optimizer, an LR jump): discarding this step's update undoes nothing,
    and skipping every other step of a runaway hides its growth from the cascade detector
    that measures it (`recover.backoff` cuts the LR by it). Recorded, not acted on."""
    return not (alarm.kind == "spike" and alarm.signal == "loss"
                and getattr(alarm, "cause", None) != BAD_BATCH)


def is_bad_batch(alarms: list[Any]) -> bool:
    """Whether the spike detector named this step's batch the cause of its spike."""
    return any(getattr(a, "cause", None) == BAD_BATCH for a in alarms)


def rows_of(found: dict[str, Any]) -> list[int]:
    """The batch rows a spike's explanation blamed (`pinpoint.live.explain_spike`: samples
    whose own loss or gradient norm is an outlier; known with a replay), in row order."""
    return sorted({int(d["index"]) for key in ("samples", "loss_samples")
                   for d in found.get(key) or []})


def spike_entry(stats: Any, alarm: Any, found: dict[str, Any]) -> dict[str, Any]:
    """What a report.json `spikes` entry gains when the batch is the cause of the spike
    `alarm` of step `stats`: `cause`, `batch` (its fingerprint, `batch_fingerprint`) and
    `rows`. Empty otherwise."""
    if getattr(alarm, "cause", None) != BAD_BATCH:
        # Ruled out when no row's gradient stood out at all (the replay's own outlier test)
        # and no row's loss by `ROW_Z`: a gradient carried by one row short of `ROW_Z` is too
        # little to name the batch, not evidence against it (the README demo's outlier
        # sample at z 8.6: its skip keeps the run out of a cascade); a few rows' losses at
        # 4-6 sigma are a batch's ordinary spread (nanoGPT's lr_wd at its first spike).
        if alarm.kind == "spike" and rows_measured(found) and not found.get("samples") and not any(
                float(d.get("z", 0.0)) >= ROW_Z for d in found.get("loss_samples") or []):
            # (on the alarm object, for the policy that weighs it: `ruled_out`)
            alarm.rows_ruled_out = True
        return {}
    rows = rows_of(found)
    # The rows ride on the alarm object (never in report.json: the entry holds them) for the
    # action that answers the spike: its skip names them (`describe`).
    alarm.named_rows = rows
    return {"cause": BAD_BATCH, "batch": batch_fingerprint(list(stats.sample_hashes)),
            "rows": rows}


def rows_measured(found: dict[str, Any]) -> bool:
    """Whether a spike's explanation (`pinpoint.live.explain_spike`) measured every row of its
    batch before the update: each row's own loss and gradient norm (a replay ran, one sample
    per row, nothing failed)."""
    return "rerun" in found and "loss_samples" in found and "error" not in found


def ruled_out(alarms: list[Any]) -> bool:
    """Whether the replay of a spike's batch ruled the batch out as its cause: every row
    measured (`rows_measured`), none an outlier among the others in its gradient
    (`pinpoint.spike.norm_outliers`) nor `ROW_Z` robust sigma out in its loss, and the batch
    not named for its own loss. Its gradient rose in every row
    together: the optimizer's spike (the weights moved to where every batch's gradient is
    large), not the data's; a discarded update answers nothing (`policy.recurrence`)."""
    return not is_bad_batch(alarms) and any(getattr(a, "rows_ruled_out", False)
                                            for a in alarms)


def describe(stats: Any, alarms: list[Any]) -> str:
    """`; a bad batch (batch FP, rows [R])` for an action's detail when the batch is the
    cause (the rows when its replay named them, `spike_entry`)."""
    if not is_bad_batch(alarms):
        return ""
    fp = batch_fingerprint(list(stats.sample_hashes))
    rows = next((r for a in alarms if (r := getattr(a, "named_rows", None))), None)
    named = ", ".join(([f"batch {fp}"] if fp else [])
                      + ([f"rows {rows[:16]}{' ...' if len(rows) > 16 else ''}"]
                         if rows else []))
    return f"; a bad batch{f' ({named})' if named else ''}: LR and weight decay left alone"
