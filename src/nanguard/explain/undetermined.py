"""The `undetermined` entry: what a `failed` run's diagnosis says when no rule had the evidence.

A failed run never ends with an empty diagnosis. When no cause of the vocabulary could be
given, this entry says so, names the evidence that was missing (no non-finite value was seen
before the run was stopped; an origin from the watched signals only, without the op; an op
whose inputs no rule explains, or whose input ranges were not recorded) and how to get it, in
the user's entry point's terms (`nanguard run` flags for zero-code users, the `Guard(...)` or
callback options for API and framework users). It works from report data alone, so a report
rebuilt from a run store (a killed process) gets one too.
"""

from __future__ import annotations

from typing import Any

from nanguard.explain.evidence import Cause
from nanguard.explain.rules.semantics import known_op

CAUSE = "undetermined"

_REPLAY_OPTION = {
    "api": "pass `replay=` (your forward and loss for a batch) to `Guard(...)`",
    "lightning": "pass `replay=` (e.g. `lambda batch: module.training_step(batch, 0)`; one "
                 "optimizer) to `NanguardCallback(...)`",
    "transformers": "pass `replay=` (a function of a batch returning its loss) to "
                    "`NanguardCallback(...)`",
}
"""How a run of each entry point gets a re-run of the failing step under the op checker.
`nanguard replay RUN` is not among them: it re-runs only what `nanguard run` and `nanguard
demo` recorded (an API run's folder does not say how to start the script)."""
CONFIDENCE = 0.0
"""It claims nothing: ranked after every cause."""


def undetermined(first_nonfinite: dict[str, Any] | None, *, alarms: list[dict[str, Any]],
                 actions: list[dict[str, Any]], entry: str = "api") -> Cause:
    """The entry for a failed run no rule explained.

    Args:
        first_nonfinite: report.json's `first_nonfinite` (None: the run was stopped before
            any non-finite value).
        alarms: the run's alarms (what stopped it, when nothing non-finite was seen).
        actions: the run's actions (`raise`, `give_up`).
        entry: `run` (zero code) or `api`: which knobs the text names.
    """
    run = entry == "run"
    rerun = ("rerun with `nanguard run --policy raise <your script> ...`" if run
             else _REPLAY_OPTION.get(entry, _REPLAY_OPTION["api"])
             + ", or run the script under `nanguard run` (it re-runs the failing step under "
               "the op checker by itself)")
    if first_nonfinite is None:
        stop = next((a for a in actions if a.get("action") in ("raise", "give_up")), None)
        kinds = sorted({str(a.get("kind")) for a in alarms if a.get("kind") != "nonfinite"})
        at = f" at step {stop.get('step')}" if stop else ""
        evidence = (f"the run was stopped{at} ({', '.join(kinds) or 'no alarm'}) before any "
                    "value went non-finite: there is no failing op to explain")
        fix = ("to see where it goes non-finite, " + (
            "rerun with `nanguard run --policy observe <your script> ...`" if run
            else "rerun with `Guard(..., policy='observe')`")
            + "; the alarms above say what grew")
        return Cause(cause=CAUSE, confidence=CONFIDENCE, evidence=evidence, fix=fix)
    step = first_nonfinite.get("step")
    signals = ", ".join(str(s) for s in first_nonfinite.get("signals") or []) or "a value"
    op = first_nonfinite.get("op")
    if not op:
        evidence = (f"non-finite at step {step} in: {signals}; but no op-level origin was "
                    "found (the step was not re-run under the op checker, or the re-run did "
                    "not reach it): the op, its inputs and the batch rows are missing")
        fix = f"to find the op, {rerun}" + (
            " (its re-run of the failing step names the op; give it the time with "
            "`--replay-budget SECONDS` if it ran out or was off)" if run else "")
        return Cause(cause=CAUSE, confidence=CONFIDENCE, evidence=evidence, fix=fix)
    where = f"{op} ({first_nonfinite.get('phase') or '?'} phase"
    module = first_nonfinite.get("module")
    where += f", `{module}`" if module else ""
    where += f") at {first_nonfinite.get('source')}" if first_nonfinite.get("source") else ")"
    inputs = first_nonfinite.get("inputs") or []
    if inputs and not known_op(str(op)):
        ranges = "; ".join(_range(i) for i in inputs[:3])
        missing = (f"{op} is not in nanguard's op table (no rule knows how it makes a "
                   f"non-finite value); its inputs: {ranges}")
    elif inputs:
        ranges = "; ".join(_range(i) for i in inputs[:3])
        missing = (f"its inputs ({ranges}) match no mechanism the op table has for {op} (no "
                   "zero or negative at a singular point, no huge magnitude, no mask)")
    if inputs:
        fix = "look at that line with these input ranges" + (
            f"; `nanguard replay RUN --step {step}` re-runs the step and prints the origin "
            "again" if run else "")
    else:
        missing = "its input ranges were not recorded, so no rule could test its inputs"
        fix = f"to record them, {rerun}"
    evidence = f"the first non-finite value at step {step} came from {where}; {missing}"
    return Cause(cause=CAUSE, confidence=CONFIDENCE, evidence=evidence, fix=fix)


def _range(i: dict[str, Any]) -> str:
    """An input as the checker recorded it: its range, or its shape when it has no elements."""
    if i.get("min") is None and i.get("max") is None:
        return f"shape {i.get('shape')}, no elements {i.get('dtype') or ''}".strip()
    return f"[{i.get('min')}, {i.get('max')}] {i.get('dtype') or ''}".strip()
