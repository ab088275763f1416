"""Pinpointing inside a live step, for the Guard: plain inputs in, findings out.

Each function runs inside the optimizer-step hook of the step it looks at (before the update
when a replay is involved: the parameters are still the step's own) and returns what it found
as plain data; the guard records it (`record.runlog`). None of them raises: a failing replay
or explanation becomes part of what is returned, and training goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from nanguard.detect.locate import locate
from nanguard.pinpoint.step_replay import activations_paused, carried_by, replay_batches
from nanguard.record.finding import Finding
from nanguard.watch.activations import ActivationProbe
from nanguard.watch.batch import BatchProbe
from nanguard.watch.stats import StepStats

Replay = Callable[[Any], torch.Tensor]


def locate_step(stats: StepStats, param_names: list[str], rank: int, *, order: list[int],
                buffer_names: list[str]) -> dict[str, Any]:
    """Where the first non-finite value of step `stats` showed, from its signals alone
    (`detect.locate`), marked when it was in a batch the GradScaler skipped, or (`script`)
    when only an activation of the step's forwards was non-finite while its loss, gradients,
    parameters and optimizer state stayed finite: the forward that held it never reached the
    update (the script's own `if not torch.isfinite(loss): continue`, an evaluation pass)."""
    found = locate(stats, param_names, rank, order=order, buffer_names=buffer_names)
    if stats.dropped_samples:  # the batch of a step the GradScaler skipped
        found["skipped_by"] = "GradScaler"
    elif stats.nonfinite_signals() == ["activation"]:
        found["skipped_by"] = "script"
    return found


def explain_spike(stats: StepStats, *, replay: Replay | None, model: nn.Module,
                  params: list[torch.Tensor], param_names: list[str], batches: BatchProbe,
                  act_probe: ActivationProbe | None, baseline: dict[int, float],
                  step_rng: dict[str, Any] | None, amp: bool,
                  loss_level: float | None = None) -> dict[str, Any]:
    """Which layers carry a spike (always) and which samples cause it (with `replay`: pass it
    only when the spike is seen before its update, so the parameters are the step's own),
    plus a re-run verdict then (`rerun`). `loss_level`: the loss's recent level before the
    spike, against which the rows' own losses are judged (`pinpoint.inprocess.spike_sources`).
    The spike's entry for the run log (no `step`)."""
    from nanguard.pinpoint.inprocess import spike_sources
    from nanguard.pinpoint.sample_axis import drop_if_not_samples, watch_sample_axis

    def sources(size: int, width: int = 0) -> tuple[dict[str, Any], list[int]]:
        # per-sample forwards: not the step's; and is dim 0 their sample axis?
        with activations_paused(act_probe), watch_sample_axis(model) as widths:
            found = spike_sources(
                replay or (lambda _batch: torch.zeros(())), model=model,
                params=params, param_names=param_names,
                batch=batches.last, grad_norms=stats.grad_norms,
                baseline=baseline, batch_size=size,
                step_rng=step_rng, loss_level=loss_level,
                batch_loss=stats.loss if stats.loss and stats.loss > 0 else None, width=width,
            )
        return found, widths

    try:
        found, widths = sources(len(stats.sample_hashes) if replay else 0)
        n = max(widths, default=1)
        if n > 1 and replay is not None:
            # Sequence-first (`pinpoint.sample_axis`): its samples are the n columns of dim 1.
            found, widths = sources(n, width=n)
        drop_if_not_samples(found, widths)
    except Exception as exc:  # noqa: BLE001 - an explanation must never stop training
        found = {"layers": [], "samples": [], "error": f"{type(exc).__name__}: {exc}"}
    if replay is not None:
        found["rerun"] = rerun(stats, replay, model=model, params=params, batches=batches,
                               act_probe=act_probe, step_rng=step_rng, amp=amp)
    return found


def loss_level(detectors: Iterable[object]) -> float | None:
    """The loss's recent level before this step (the spike detector's: the median of its
    latest `spike_level_steps` healthy losses, which a spike never joins), or None before it
    has any: what a spiking batch's rows are judged against (`explain_spike`)."""
    from nanguard.detect.spike import SpikeDetector
    from nanguard.detect.trend import recent_level

    for d in detectors:
        if isinstance(d, SpikeDetector) and (hist := d.history["loss"]):
            return float(10 ** recent_level(hist, d.config.spike_level_steps))
    return None


def row_suspect(detectors: Iterable[object], step: int) -> str | None:
    """The spike detector's LR note when step `step`'s grad-norm spike came after a quiet step
    at a steady LR with the batch's loss at its level (`SpikeDetector.row_suspect`): what a
    bad batch named on its rows alone needs besides the rows (`detect.bad_batch.by_rows`)."""
    from nanguard.detect.spike import SpikeDetector

    for d in detectors:
        if isinstance(d, SpikeDetector) and d.row_suspect and d.row_suspect[0] == step:
            return d.row_suspect[1]
    return None


def spike_note(found: Mapping[str, Any]) -> str:
    """What the alarm's message gains from `explain_spike`: the layers and samples that
    carry it, and the re-run verdict."""
    note = carried_by(dict(found))
    if found.get("rerun", {}).get("verdict"):
        note += f"; re-run: {found['rerun']['verdict']}"
    return note


def rerun(stats: StepStats, replay: Replay, *, model: nn.Module, params: list[torch.Tensor],
          batches: BatchProbe, act_probe: ActivationProbe | None,
          step_rng: dict[str, Any] | None, amp: bool) -> dict[str, Any]:
    """Does the alarmed step (before its update) re-run the same? (`pinpoint.rerun`).
    Only for a step one batch made, without a GradScaler (`amp`: its gradients are scaled)."""
    from nanguard.pinpoint.rerun import rerun_verdict

    if len(batches.step_batches) > 1 or amp:
        return {"verdict": None, "why": "several micro-batches or a GradScaler: the step's "
                "gradients are not one re-runnable forward and backward"}
    try:
        with activations_paused(act_probe):
            return rerun_verdict(replay, model=model, params=params, batch=batches.last,
                                 step_rng=step_rng, loss=stats.loss,
                                 clip_norm=stats.clip_norm)
    except Exception as exc:  # noqa: BLE001 - a verdict must never stop training
        return {"verdict": None, "why": f"the re-run failed: {type(exc).__name__}: {exc}"}


def scaler_skip_finding(stats: StepStats, replay: Replay, *, model: nn.Module,
                        params: list[torch.Tensor], skipped: list[Any],
                        act_probe: ActivationProbe | None, rank: int) -> dict[str, Any] | None:
    """The GradScaler skipped the step before this one: an fp16 overflow, or a real fault
    (sqrt at 0, a NaN row) that it hid? The `skipped` batches are replayed in float32
    (outside autocast) from the same parameters (a skipped step changed none): a value that
    is non-finite there too was not an overflow, and its finding is returned. None: the skip
    stays what the scaler said it was."""
    if not skipped:
        return None
    try:
        found = replay_batches(replay, model=model, params=params, batches=skipped,
                               step=stats.step, loss=stats.loss, step_rng=None,
                               act_probe=act_probe)
    except Exception:  # noqa: BLE001 - the skip stays what the scaler said it was
        return None
    if found is None:
        return None
    found.update(step=stats.step, rank=rank, signals=["grad"], skipped_by="GradScaler")
    return found


def refine_by_replay(finding: Finding, stats: StepStats, replay: Replay, *,
                     model: nn.Module, params: list[torch.Tensor], batches: BatchProbe,
                     act_probe: ActivationProbe | None, step_rng: dict[str, Any] | None
                     ) -> tuple[dict[str, Any], bool]:
    """Replay the step of `finding` before its update, under the op checker: what to merge
    into the finding, and whether that is news to record (False: only a `replay_error`).
    Empty for a finding of loaded state (no op of this step made it)."""
    from nanguard.pinpoint.rerun import context as rerun_context

    if finding.get("phase") == "checkpoint":
        return {}, False
    # NaN rows of a batch the GradScaler skipped: that batch is the one to replay.
    todo = (batches.skipped if stats.dropped_samples and batches.skipped
            else batches.step_batches or [batches.last])
    try:
        found = replay_batches(replay, model=model, params=params, batches=todo,
                               step=stats.step, loss=stats.loss,
                               step_rng=None if stats.dropped_samples else step_rng,
                               act_probe=act_probe)
    except Exception as exc:  # noqa: BLE001 - a failing replay must not kill training
        return {"replay_error": f"{type(exc).__name__}: {exc}"}, False
    if found is None:
        # The same step from the same parameters, RNG states and batch ran clean: what
        # made the value is not in them (a non-deterministic kernel, state outside the
        # RNG, a device fault: `pinpoint.rerun`).
        return {"reproduced": False, "verdict": "transient", **rerun_context(params)}, True
    # The rank stays the one the finding was located on (the replay's checker says 0).
    update = {k: v for k, v in found.items()
              if (v is not None or k == "reproduced") and k != "rank"}
    if isinstance(found.get("reproduced"), bool):  # the replay re-ran the step bit for bit
        update["verdict"] = "reproducible" if found["reproduced"] else "transient"
        update.update(rerun_context(params))
    update["signals"] = finding.get("signals")
    return update, True
