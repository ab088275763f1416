"""A Guard's state across a resume: what `Guard.state_dict` returns and `load_state_dict` restores.

Plain data (numbers, strings, lists, dicts), saved with the user's checkpoint by hand or by the
framework adapters. Its keys, in order, and the part each comes from:

- `step`: optimizer steps the guard completed (the step path's counter);
- `detectors`: each detector's own state, in `detect.default_detectors` order;
- `alarms`, `actions`, `first_nonfinite`, `spikes`: the run log's records (`RunLog.state_dict`);
- `recovery`: recovery's counters and settings in force (`Recovery.state_dict`; a `heal`
  guard loading a state saved under another policy starts its statistics from the grad norms
  of `log`'s steps); the rollback snapshot is not in it (a full copy of the model): after a
  resume the last good state is the one the guard was created with;
- `grad_baseline`: each parameter's typical healthy grad norm (what a spike is measured against);
- `log`: the last steps and the failing step of `Guard.run_log()`, so that a resumed guard
  diagnoses with the history from before the resume;
- `resume`: the loss level at save (`recover.loss_after`): the first steps after the resume
  are compared with it. The LR at save rides in `recovery` (`policy.lr_change`): a resume whose
  first step runs at 10x it is an LR jump at that step;
- `sampling`: the watch set's sampler (`watch.sampling`);
- `policy`: the policy's memory of a recurring instability's spikes (`Policy.state_dict`), so
  that a spike right after the resume is judged with the ones before it.

`take_baselines` hands detector baselines from one live guard to the next (a new optimizer
over the same parameters every epoch).

Older states may lack `recovery`, `grad_baseline`, `spikes`, `log`, `resume`, `sampling` and
`policy`; they load with those parts left as the new guard has them (`grad_baseline` empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanguard.detect.detectors import Detector
from nanguard.pinpoint.baseline import GradBaseline
from nanguard.record.runlog import HISTORY
from nanguard.recover.loss_after import LossAfter, loss_level
from nanguard.step.build import Parts
from nanguard.step.state import StepState


def gather(state: StepState, parts: Parts, plain_log: Mapping[str, Any]) -> dict[str, Any]:
    """The state of a guard's pipeline (`state`, `parts`; see the module docstring);
    `plain_log`: its `run_log()`, read after every pending step was flushed (the caller's
    job: flushing may raise an alarm)."""
    return {
        "step": state.step,
        "detectors": [d.state_dict() for d in parts.detectors],
        **parts.log.state_dict(),
        "recovery": parts.recovery.state_dict(),
        "grad_baseline": {str(i): v for i, v in state.grad_baseline.values().items()},
        "log": {"history": plain_log["history"][-HISTORY:], "failing": plain_log["failing"]},
        "resume": {"loss": loss_level(s.loss for s in parts.log.history)},
        "sampling": parts.steps.sampler.state_dict(),
        "policy": parts.policy.state_dict(),
    }


def restore(state: StepState, parts: Parts, saved: Mapping[str, Any]) -> None:
    """Put `saved` (what `gather` returned) back. Raises ValueError, before anything
    changed, when it comes from a guard with a different set of detectors."""
    detectors = parts.detectors
    if len(saved["detectors"]) != len(detectors):
        raise ValueError("state_dict comes from a guard with a different set of detectors")
    state.step = int(saved["step"])
    for d, s in zip(detectors, saved["detectors"], strict=True):
        d.load_state_dict(s)
    parts.log.load_state_dict(saved)
    recovery = parts.recovery
    if "recovery" in saved:
        recovery.load_state_dict(saved["recovery"])
    healer = recovery.healer
    if healer is not None and not (saved.get("recovery") or {}).get("heal"):
        # Saved under another policy: heal starts from the grad norms before the save.
        healer.seed([h.get("grad_norm") for h in (saved.get("log") or {}).get("history", [])
                     if isinstance(h, dict)])
    state.grad_baseline = GradBaseline({int(i): float(v)
                                        for i, v in saved.get("grad_baseline", {}).items()})
    state.loss_after = LossAfter.resumed(saved.get("resume"), state.step)
    parts.steps.sampler.load_state_dict(saved.get("sampling"))
    parts.policy.load_state_dict(saved.get("policy") or {})


def take_baselines(mine: list[Detector], theirs: list[Detector]) -> None:
    """`Guard.take_baselines`: each series detector of `mine` starts from its counterpart's
    baselines in `theirs` (same order and class); other detectors are left alone."""
    if len(mine) != len(theirs):
        return
    for d, other in zip(mine, theirs, strict=True):
        take = getattr(d, "take_baselines", None)  # the series detectors'
        if take is not None and type(d) is type(other):
            take(other)
