"""Rules read from the magnitudes of the first steps and the alarms of a run: an init too
large (`exploding_init`, from the run's magnitudes or the preflight's measurement), gradient
spikes without a NaN (`bad_batch`) and vanishing gradients.
"""

from __future__ import annotations

import math
from typing import Any

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.rules.common import (
    EARLY,
    HUGE,
    first_jump,
    json_num,
    ordinary_before,
    preflight_init,
    transient_jump,
    where_of,
)
from nanguard.explain.rules.faults import weigh_verdict


def exploding_init(ev: Evidence) -> Cause | None:
    """Needs: a failure in steps 0-2 (forward or loss; backward at step 0) with evidence of
    huge magnitudes there: an activation abs-max or grad norm >= 1e6 in those steps, an
    overflow / forecast alarm, or the origin op's inputs >= 1e6. Ruled out: magnitudes
    measured and ordinary (a log(0) at step 1 is not an init problem), spike / cascade alarms
    or a one-step jump after an update (optimizer_divergence). Nothing measured: it fires at
    low confidence and says what is missing. A value no op made (`kind` state / input, the
    guard's checkpoint finding) or an op fed a NaN is never an init overflow.

    With a preflight (`Evidence.preflight`) that measured layers initialised too large, a
    failure up to step `EARLY` is the init's whatever the updates did (a huge init makes huge
    gradients, the first updates then jump: optimizer_divergence sees the symptom); the
    confidence is highest when the failing layer is one of those measured. A preflight that
    measured every layer within range lowers the confidence of the rule's other evidence."""
    first = ev.first_nonfinite or {}
    flagged, hit = preflight_init(ev)
    if (flagged and ev.step is not None and ev.step <= EARLY
            and ev.phase not in ("data", "checkpoint") and first.get("kind") not in
            ("state", "input") and not first.get("tensors")):
        return weigh_verdict(ev, _init_measured(ev, flagged, hit))
    cause = _exploding_init(ev)
    layers = (ev.preflight or {}).get("layers") or []
    if cause is not None and layers and not flagged:
        top = max(layers, key=lambda layer: json_num(layer.get("ratio"), 0.0))
        cause.confidence = round(cause.confidence * 0.5, 3)
        cause.evidence += (f"; but the preflight measured every layer's init within range "
                           f"(largest: `{top.get('name')}` at "
                           f"{json_num(top.get('ratio'), math.nan):.3g}x 1/sqrt(fan_in))")
    return None if cause is None else weigh_verdict(ev, cause)


def _init_measured(ev: Evidence, flagged: list[dict[str, Any]],
                   hit: dict[str, Any] | None) -> Cause:
    """exploding_init from the preflight's measurement of the init."""
    lead = hit or flagged[0]
    others = [f.get("location") for f in flagged if f is not lead]
    also = (f" and {len(others)} more layer(s) ({', '.join(map(str, others[:4]))}"
            + (", ..." if len(others) > 4 else "") + ")") if others else ""
    loss = _untrained_loss(ev)
    at = "the failing layer " if hit is not None else ""
    evidence = (f"before training, the preflight measured {at}{_layer_text(lead)}{also} "
                "(PyTorch's default gives 0.58x, Kaiming 1.4x)"
                + (f"; the untrained model's loss on the first batch was {loss:.3g}"
                   if loss is not None else "")
                + f"; {where_of(ev)} went non-finite at step {ev.step}")
    call = (lead.get("details") or {}).get("init_call") or "nn.init.kaiming_normal_(w, " \
        "nonlinearity='relu')"
    fix = f"{call}{' for every layer listed' if others else ''}, or drop the custom init " \
        "(PyTorch's default gives 0.58x)"
    return Cause(cause="exploding_init", confidence=0.92 if hit is not None else 0.9,
                 evidence=evidence, fix=fix)


def _exploding_init(ev: Evidence) -> Cause | None:
    """exploding_init from the run's own magnitudes (see `exploding_init`)."""
    if ev.step is None or ev.step > 2:
        return None
    if ev.phase not in ("forward", "loss") and not (ev.phase == "backward" and ev.step == 0):
        return None
    first = ev.first_nonfinite or {}
    if first.get("kind") in ("state", "input") or first.get("tensors"):
        return None  # no op made it: it was loaded or fed in (checkpoint / data)
    if any(i.get("nonfinite") and math.isnan(json_num(i.get("min"), 0.0)) for i in ev.inputs):
        return None  # the op received a NaN: it carried a value on, it overflowed nothing
    if ev.warnings_before(("spike", "cascade")) or first_jump(ev) or ordinary_before(ev):
        return None  # the update made it (optimizer_divergence), not the init
    seen, what = early_magnitude(ev)
    if seen is False:
        return None
    if seen is None:
        if ev.phase == "backward":
            return None
        return Cause(
            cause="exploding_init",
            confidence=0.3,
            evidence=f"{where_of(ev)} went non-finite within the first steps, but no magnitude "
            "was measured (no activation abs-max, finite grad norm or op input range): an "
            "init too large is only a guess from the timing; rerun with `activations=True` "
            "or a replay to confirm",
            fix="check the init with `nanguard.preflight(model, batch, ...)`; if activations "
            "grow layer after layer, use `nn.init.kaiming_normal_(w, nonlinearity='relu')`",
        )
    return Cause(
        cause="exploding_init",
        confidence=0.8,
        evidence=f"huge magnitudes before training could move the weights ({what}); "
        f"the value overflowed at {where_of(ev)}",
        fix="use the default init or `nn.init.kaiming_normal_(w, nonlinearity='relu')` "
        "(std = gain / sqrt(fan_in)); check with `nanguard.preflight(model, batch, ...)`",
    )


def early_magnitude(ev: Evidence) -> tuple[bool | None, str]:
    """Huge activations / grad norms in steps 0-2 (up to the failure): (True: seen, False:
    measured and not huge, None: nothing measured), with the evidence phrase."""
    measured: list[str] = []
    for h in ev.steps_until_failure():
        if h.get("step", 99) > 2:
            continue
        for signal, label in (("act_max", "activation abs-max"), ("grad_norm", "grad norm")):
            v = json_num(h.get(signal), math.nan)
            if math.isfinite(v):
                if v >= HUGE:
                    return True, f"{label} {v:.3g} at step {h['step']}"
                measured.append(signal)
    for a in ev.alarms:
        if a.get("kind") in ("overflow", "forecast") and a.get("step", 99) <= 2:
            return True, f"{a['kind']} alarm at step {a['step']}: {a.get('message', '')}"
    top = ev.magnitude
    if top is not None:
        if top >= HUGE:
            return True, f"inputs of {ev.op} as large as {top:.3g}"
        measured.append("inputs")
    if measured:
        return False, ""
    return None, ""


def _layer_text(f: dict[str, Any]) -> str:
    d = f.get("details") or {}
    return (f"`{f.get('location')}`: weight std {json_num(d.get('std'), math.nan):.3g} = "
            f"{json_num(d.get('ratio'), math.nan):.3g}x 1/sqrt(fan_in)")


def _untrained_loss(ev: Evidence) -> float | None:
    pf = ev.preflight or {}
    v = json_num((pf.get("overfit") or {}).get("first_loss"), math.nan)
    return v if math.isfinite(v) else None


RUNAWAY = ("divergence", "cascade", "forecast", "overflow")
"""Alarms of an error growing step after step: after untraced spikes, the optimizer's story."""


def bad_batch(ev: Evidence) -> Cause | None:
    """Needs: a spike alarm on a run that never went non-finite; confident when the detectors
    named its batch the cause (`cause: bad_batch`: the batch's own loss an outlier after a
    quiet step at an unchanged LR, `detect.bad_batch`); unlikely when no spike was traced and
    the run ran away after them (`RUNAWAY`). Ruled out: any non-finite value (the rules above
    explain it)."""
    if ev.first_nonfinite is not None:
        return None
    spikes = [a for a in ev.alarms if a["kind"] == "spike"]
    if not spikes:
        jump = transient_jump(ev)
        if jump is None:
            return None
        return Cause(
            cause="bad_batch",
            confidence=0.5,
            evidence=f"the loss jumped {jump['before']:.3g} -> {jump['after']:.3g} at step "
            f"{jump['step']} and was back to {jump['next']:.3g} one step later: that step's "
            "batch made it, not the training (an error the optimizer feeds back does not "
            "vanish in one update)",
            fix=f"look up the batch of step {jump['step']} (its sample fingerprints are in "
            "run.db, table `batches`) and scan the data (`nanguard scan`) for extreme values "
            "or labels",
        )
    named = sorted({a["step"] for a in spikes if a.get("cause") == "bad_batch"})
    if named:
        return weigh_verdict(ev, Cause(
            cause="bad_batch",
            confidence=0.9,
            evidence=f"the spikes at steps {named[:6]} came from their batches: each batch's "
            "own loss, computed before its update after a quiet step at an unchanged LR, stood "
            "far above its recent level: the data, not the model or the optimizer",
            fix="find those batches (report.json `spikes`: each one's fingerprint `batch` and "
            "the `rows` that stand out; run.db table `batches`) and clean that data (`nanguard "
            "scan`); the LR and the weight decay need no change; `--policy skip` or `heal` keep "
            "such batches' updates out meanwhile",
        ))
    steps = sorted({a["step"] for a in spikes})
    runaway = [a for a in ev.alarms if a["kind"] in RUNAWAY and a["step"] >= steps[0]]
    if runaway:
        # The spikes were the start of a runaway: the error grew step after step, which one
        # batch does not do (its loss is back the step after, `transient_jump`); a batch that
        # set the optimizer off is still not ruled out (none was replayed clean).
        first = min(runaway, key=lambda a: a["step"])
        return weigh_verdict(ev, Cause(
            cause="bad_batch",
            confidence=0.25,
            evidence=f"gradient spikes at steps {steps[:6]} without a NaN, none of them traced "
            f"to its batch, and the run ran away after them ({first['kind']} at step "
            f"{first['step']}): the optimizer feeding the error back is the likelier story; a "
            "batch that set it off is not ruled out",
            fix="look up the first spike's batch fingerprints in run.db (table `batches`) and "
            "scan the data (`nanguard scan`)",
        ))
    return weigh_verdict(ev, Cause(
        cause="bad_batch",
        confidence=0.5,
        evidence=f"gradient spikes at steps {steps[:6]} without a NaN, none of them traced to its "
        "batch (`bad_batch` named on none): finite but extreme samples are not ruled out",
        fix="look up those steps' batch fingerprints in run.db (table `batches`) and scan the "
        "data (`nanguard scan`); clip the grad norm",
    ))


def vanishing_gradients(ev: Evidence) -> Cause | None:
    """Needs: a vanishing alarm. Ruled out: none raised."""
    alarms = [a for a in ev.alarms if a["kind"] == "vanishing"]
    if not alarms:
        return None
    return Cause(
        cause="vanishing_gradients",
        confidence=0.6,
        evidence=alarms[0]["message"],
        fix="check for dead ReLUs (use LeakyReLU/GELU), saturated sigmoids/tanh, a too small "
        "init, or a detach() that cuts the graph; add residual connections or normalization",
    )
