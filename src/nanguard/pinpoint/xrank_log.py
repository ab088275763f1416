"""What a rank asks of, and records from, a cross-rank re-run (`pinpoint.xrank`).

`request` reads this rank's re-run verdicts of the step in progress from its run log (the
spike re-runs and the first non-finite step's replay, made before the pre-step agreement);
`record` writes the verdict every rank computed alike into the same places: each spike's
`rerun` of the step (its `verdict` becomes the cross-rank one, the rank's own kept as
`local_verdict`), the first non-finite finding of the step, the spike alarms' messages, and,
for `persistent` on rank r, a `replica_divergence` alarm on every rank naming rank r (a
device that computes differently from its replicas: recorded, never acted on by a policy).
"""

from __future__ import annotations

from typing import Any

from nanguard.detect.alarm import Alarm
from nanguard.pinpoint.xrank import label, priority
from nanguard.record.runlog import RunLog


def _own_loss(found: dict[str, Any]) -> bool:
    """The non-finite value showed in this rank's own data, forward or loss (its batch's
    alone: DDP averages only the gradients)."""
    return found.get("phase") in ("data", "forward", "loss")


def request(log: RunLog, step: int) -> tuple[int, dict[str, Any] | None]:
    """(this rank's priority for a cross-rank re-run of `step`, the re-run verdict it rests on)
    from the verdicts its log holds for `step`; (0, None) when there is none."""
    best: tuple[int, dict[str, Any] | None] = (0, None)
    for sp in log.spikes:
        if sp["step"] == step and isinstance(sp.get("rerun"), dict):
            best = max(best, (priority(sp["rerun"], own_loss=False), sp["rerun"]),
                       key=lambda b: b[0])
    finding = log.finding
    if finding is not None and finding.get("step") == step and finding.get("verdict"):
        found = finding.to_dict()
        own = _own_loss(found)
        best = max(best, (priority(found, own_loss=own, transient_counts=own), found),
                   key=lambda b: b[0])
    return best


def record(log: RunLog, step: int, alarms: list[Alarm], verdict: dict[str, Any]) -> None:
    """Record the cross-rank `verdict` of `step` (the same on every rank; see the module)."""
    v = verdict.get("verdict")
    for sp in log.spikes:
        rerun = sp.get("rerun")
        if sp["step"] != step or not isinstance(rerun, dict):
            continue
        rerun["cross_rank"] = verdict
        if v is not None:
            rerun["local_verdict"] = rerun.get("verdict")
            rerun.update(verdict=v, rank=verdict["rank"])
    finding = log.finding
    if finding is not None and finding.get("step") == step and v is not None:
        log.refine_finding({"local_verdict": finding.get("verdict"), "verdict": v,
                            "cross_rank": verdict}, announce=False)
    note = f"; across ranks: {label(verdict)}" if v else ""
    for a in alarms:
        if a.kind == "spike" or (a.kind == "overflow" and a.signal == "grad_norm"):
            a.message += note
    if v == "persistent":
        r = verdict["rank"]
        log.add_alarm(Alarm(
            step=step, kind="replica_divergence", signal="rerun", value=float(r),
            message=f"persistent on rank {r}: it computes step {step} differently from its "
                    f"replicas ({verdict['why']})"))
