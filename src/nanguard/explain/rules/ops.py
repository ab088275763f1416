"""Rules for an op that made a non-finite value at a bad point of its domain: a log of values
<= 0, a saturated probability before a loss's log, the infinite derivative of sqrt / a norm
at 0, a fully masked softmax row, an exp overflow, and an overflow of a reduced-precision
dtype float32 would hold. Divisions are in `division`, the other ops of the table in
`semantics`.
"""

from __future__ import annotations

import math

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.fixes import log_scale, saturated_log, sqrt_at_zero
from nanguard.explain.rules.common import (
    LOW_PRECISION,
    NORM_LAYERS,
    SINGULAR_OPS,
    finfo_of,
    json_num,
    origin_node,
    overflow_scale,
    singular_input,
    singular_node,
    where_of,
)

_LOG_OPS = ("aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy")

_SOFTMAX_OPS = (
    "aten._softmax",
    "aten.softmax",
    "aten._log_softmax",
    "aten.log_softmax",
    "aten._safe_softmax",
    "aten.logsumexp",
)


def _any_input(ev: Evidence, key: str) -> bool:
    return any(i.get(key) for i in ev.inputs)


def log_of_nonpositive(ev: Evidence) -> Cause | None:
    """Needs: origin op a log (not in backward) and its input range holding zeros or negative
    values. Ruled out: input ranges with neither. Without input ranges it fires lower, saying
    so."""
    if not ev.op.startswith(_LOG_OPS) or ev.phase == "backward":
        return None
    zero = _any_input(ev, "has_zero")
    neg = _any_input(ev, "has_negative")
    if ev.inputs and not (zero or neg):
        return None
    if ev.op.startswith("aten.log1p") and ev.inputs and min(
            json_num(i.get("min"), 0.0) for i in ev.inputs) > -1.0:
        return None  # log1p is finite down to -1 (exclusive): not at its singular point
    what = "zeros" if zero else "negative values" if neg else "values <= 0"
    missing = "" if ev.inputs else " (presumably: its input ranges were not recorded)"
    return Cause(
        cause="log_of_nonpositive",
        confidence=0.9 if (zero or neg) else 0.6,
        evidence=f"{where_of(ev)} received {what}{missing}",
        fix="`torch.log(p.clamp_min(1e-12))`, or stay in log space "
        "(`F.logsigmoid`, `F.log_softmax`, `F.binary_cross_entropy_with_logits`)",
    )


def _probability(ev: Evidence) -> bool:
    """Every input of the op lies within [0, 1] and one of them touches 0: a probability that
    rounded to exactly 0 (or 1, before `1 - p`)."""
    return bool(ev.inputs) and _any_input(ev, "has_zero") and all(
        json_num(i.get("min"), -1.0) >= 0.0 and json_num(i.get("max"), 2.0) <= 1.0
        for i in ev.inputs
    )


def saturated_loss(ev: Evidence) -> Cause | None:
    """Needs: origin op binary_cross_entropy (not with logits), or a log in the loss phase
    (raw-tensor code without modules counts as loss) whose input is a probability that
    saturated to 0 (all inputs within [0, 1], a zero among them). Ruled out: a log in the
    model's forward (log_of_nonpositive), a log input outside [0, 1]. A `saturation` warning
    before the failure (the sampled probe saw probabilities a log consumes creep to within
    rounding of 0 / 1) confirms it where the input range was not recorded."""
    warned = [a for a in ev.alarms if a.get("kind") == "saturation"]
    if "binary_cross_entropy" in ev.op and "with_logits" not in ev.op:
        conf = 0.9
        what = "a probability saturated at 0 or 1 before the loss took its log"
    elif ev.op.startswith(_LOG_OPS) and ev.phase == "loss":
        if _probability(ev):
            # Ranks above the generic log_of_nonpositive: a sigmoid / softmax saturated.
            conf = 0.92
            what = ("its input is a probability (within [0, 1]) that rounded to exactly 0: "
                    "a sigmoid / softmax saturated before the log")
        elif not ev.inputs and warned:
            conf = 0.9
            what = "a log in the loss, after the saturation probe's warning"
        elif not ev.inputs:
            conf = 0.6
            what = ("a log in the loss; its input range was not recorded, so a saturated "
                    "probability is only presumed")
        else:
            return None
    else:
        return None
    if warned:
        what += (f"; the saturation probe warned from step {warned[0]['step']}: "
                 f"{warned[0]['message'].split(';')[0]}")
    fix = ("`F.binary_cross_entropy(torch.sigmoid(z), y)` -> "
           "`F.binary_cross_entropy_with_logits(z, y)`; `softmax` then `log` -> `log_softmax`; "
           "hand-written `-(y*log(h) + (1-y)*log(1-h))` with `h = sigmoid(z)` -> "
           "`F.binary_cross_entropy_with_logits(z, y)` (or `F.logsigmoid(z)`, `F.logsigmoid(-z)`)")
    if ev.op.startswith(_LOG_OPS) and (line := saturated_log(ev)) is not None:
        # The user's line says which loss it writes: its one fix, not the list.
        what, fix = what + line[0], line[1]
    return Cause(
        cause="saturated_loss",
        confidence=conf,
        evidence=f"{where_of(ev)}: {what}",
        fix=fix,
    )


def singular_gradient(ev: Evidence) -> Cause | None:
    """Needs: phase backward, the op inside the gradient of sqrt / rsqrt / pow(x, p<1) / a norm
    (its autograd node, forward op or op; or a division in backward), AND its input at the
    singular point: the denominator / base holding 0 or a value within rounding of 0.
    Ruled out: input ranges away from 0 (huge finite inputs overflowing: optimizer_divergence),
    normalization layers (LayerNorm & co. have an eps). Without input ranges it fires at low
    confidence and says the ranges are missing."""
    if ev.phase != "backward":
        return None
    fwd = str((ev.first_nonfinite or {}).get("forward_op") or "")
    node = singular_node(ev)
    if not (node or ev.op.startswith(SINGULAR_OPS) or fwd.startswith(SINGULAR_OPS)
            or ev.op.startswith(("aten.div", "aten.reciprocal"))):
        return None
    if any(layer in origin_node(ev) for layer in NORM_LAYERS):
        return None
    at, phrase = singular_input(ev)
    if at == "no":
        return None
    if at == "missing":
        conf = 0.4 if node else 0.3
        phrase = f"not confirmed: {phrase}, so an input at 0 is not shown"
    else:
        conf = 0.9 if node else 0.8
    return Cause(
        cause="singular_gradient",
        confidence=conf,
        evidence=f"{where_of(ev)}{' in ' + origin_node(ev) if origin_node(ev) else ''}: "
        f"the forward was finite, its gradient is not — sqrt / norm / pow(x, p<1) at exactly 0 "
        f"have an infinite derivative; {phrase}",
        fix=sqrt_at_zero(ev) or "`torch.sqrt(x + 1e-12)`; for a norm, "
        "`torch.sqrt((v * v).sum(-1) + 1e-12)` or `F.normalize(v, eps=1e-12)`; in a custom "
        "backward, `grad / d.clamp_min(1e-12)`",
    )


def masked_softmax(ev: Evidence) -> Cause | None:
    """Needs: origin op a softmax whose input holds -inf (a masked row).

    Ruled out: finite inputs (a softmax of finite values is finite). Without input ranges it
    fires lower."""
    if not ev.op.startswith(_SOFTMAX_OPS):
        return None
    masked = any(json_num(i.get("min"), 0.0) == -math.inf for i in ev.inputs)
    if ev.inputs and not masked:
        return None
    return Cause(
        cause="masked_softmax",
        confidence=0.9 if masked else 0.6,
        evidence=f"{where_of(ev)}: a row whose every entry is masked to -inf gives 0/0 = NaN"
        + ("" if masked else " (presumed: the input ranges were not recorded)"),
        fix="keep at least one unmasked position per row (e.g. let padding attend to itself), "
        "or fill with `torch.finfo(dtype).min` instead of -inf and zero the output rows",
    )


def exp_overflow(ev: Evidence) -> Cause | None:
    """Needs: origin op exp with an input above log(dtype max) (~88.7 in float32, ~11.1 in
    float16). Ruled out: inputs all below it. Without input ranges it fires lower."""
    if not ev.op.startswith(("aten.exp", "aten.expm1")):
        return None
    limit = math.log(finfo_of((ev.inputs[0].get("dtype") if ev.inputs else None) or ev.dtype).max)
    top = max((json_num(i.get("max"), -math.inf) for i in ev.inputs), default=None)
    if top is not None and top < limit:
        return None
    seen = f"its largest input {top:.4g} > {limit:.3g}" if top is not None else (
        "presumed: the input ranges were not recorded")
    nxt = str(((ev.first_nonfinite or {}).get("propagated_by") or {}).get("op") or "")
    if (scale := log_scale(ev)) is not None:
        what, fix = scale  # `exp(0.5 * log_var)`: a scale, no max to subtract
    elif nxt.startswith(_SOFTPLUS_NEXT):
        # `log(1 + exp(z))` / `1 + exp(z)`: a softplus or a sigmoid written by hand; no max
        # to subtract (a softmax fix would not apply).
        what = f"; its result went on into {nxt} (`log(1 + exp(z))` or `1 + exp(z)` by hand)"
        fix = ("use the stable built-ins: `torch.log(1 + torch.exp(z))` -> "
               "`F.softplus(z)`; `1 / (1 + torch.exp(-z))` -> `torch.sigmoid(z)`; a logistic "
               "loss `log(1 + exp(-y * z))` -> `F.softplus(-y * z)` (or "
               "`F.binary_cross_entropy_with_logits`)")
    else:
        what = ""
        fix = ("subtract the max first: `torch.softmax(x, dim)` / `torch.logsumexp`, or "
               "`(x - x.amax(dim, keepdim=True)).exp()`")
    return Cause(
        cause="exp_overflow",
        confidence=0.9 if top is not None else 0.6,
        evidence=f"{where_of(ev)}: exp overflows above {limit:.3g} ({seen}){what}",
        fix=fix,
    )


_SOFTPLUS_NEXT = ("aten.add", "aten.rsub", "aten.log1p", "aten.log", "aten.reciprocal")
"""Ops an exp's result flows into in a hand-written softplus / sigmoid (1 + e, log1p(e))."""


def low_precision_overflow(ev: Evidence) -> Cause | None:
    """Needs: a reduced-precision dtype and an overflow from finite inputs in forward/loss,
    with input magnitudes float32 would hold. Ruled out: inputs so large they would overflow
    float32 too (exploding_init / optimizer_divergence); a dtype with float32's range
    (bfloat16 rounds coarsely but overflows only where float32 would). Without ranges it
    fires lower."""
    if ev.dtype not in LOW_PRECISION or ev.phase not in ("forward", "loss"):
        return None
    largest = finfo_of(ev.dtype).max
    if largest > 1e38:  # bfloat16: float32's 8-bit exponent (3.39e38 against 3.40e38)
        return None
    top = ev.magnitude
    if top is not None and top >= overflow_scale("float32"):
        return None
    return Cause(
        cause="low_precision_overflow",
        confidence=0.8 if top is not None else 0.6,
        evidence=f"{where_of(ev)} overflowed {ev.dtype} (its largest value: {largest:.6g})"
        + (f"; its inputs reach {top:.3g}, fine in float32" if top is not None
           else "; the input ranges were not recorded"),
        fix="use bfloat16 instead of float16, keep this op in float32 "
        "(`with torch.autocast(..., enabled=False): ...x.float()`), or use a GradScaler",
    )
