"""What several diagnosis rules read from the evidence: op and autograd-node names, numbers
in the checker's JSON, the dtype's limits, an input at a singular point, where the value was
made, the first jump of the history, the preflight's measured init, and the user's way to turn
on recovery (or that it acted). Each rule module (`origin`, `ops`, `optimizer`, `dynamics`,
`faults`) keeps the helpers only it uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanguard.explain.evidence import Cause, Evidence

Rule = Callable[[Evidence], "Cause | None"]

SINGULAR_OPS = (
    "aten.sqrt",
    "aten.rsqrt",
    "aten.pow",
    "aten.linalg_vector_norm",
    "aten.norm",
    "aten.sqrt_backward",
)

CASCADE = ("spike", "cascade", "forecast", "overflow")

LOW_PRECISION = ("torch.float16", "torch.bfloat16", "float16", "bfloat16")

HUGE = 1e6
"""An activation abs-max or a grad norm this large is far beyond a healthy network's (O(1) to
O(1e3)), whatever the dtype: what an exploding init or a diverging optimizer shows."""

JUMP = 100.0
"""Growth of the loss or grad norm in one step that counts as a jump (not noise)."""

EARLY = 10
"""With a preflight that measured the init too large, a failure up to this step can still be
the init's (its huge gradients make the first updates explode: the jump is its symptom)."""

# Autograd nodes whose backward is singular at 0 (custom Functions count: `ClampedSqrtBackward`).
_SINGULAR_NODES = ("Sqrt", "Pow", "Norm", "Dist")

# ... but normalization layers are not: their backward has an eps and no singular point.
NORM_LAYERS = ("LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "RmsNorm", "RMSNorm",
                "WeightNorm", "LocalResponseNorm")


def origin_node(ev: Evidence) -> str:
    return str((ev.first_nonfinite or {}).get("node") or "")


def singular_node(ev: Evidence) -> bool:
    """The backward op ran inside the gradient of sqrt / rsqrt / pow / a norm (its autograd
    node), not inside a normalization layer's (LayerNorm & co. divide by sqrt(var + eps))."""
    node = origin_node(ev)
    if any(layer in node for layer in NORM_LAYERS):
        return False
    return any(name in node for name in _SINGULAR_NODES)


def json_num(v: object, default: float) -> float:
    """A number from report JSON: floats, or "nan"/"inf" strings (a checker range bound, a
    logged lr or norm), `default` when it is neither."""
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def finfo_of(dtype: object) -> torch.finfo:
    name = str(dtype or "float32").replace("torch.", "")
    try:
        return torch.finfo(getattr(torch, name))
    except (AttributeError, TypeError):
        return torch.finfo(torch.float32)


def overflow_scale(dtype: object) -> float:
    """Inputs this large (about sqrt of the dtype's largest value) overflow when multiplied:
    the signature of an overflow of huge finite magnitudes, not of a singular point."""
    return max(finfo_of(dtype).max ** 0.5 / 100, 1e3)


def _near_zero(r: dict[str, Any]) -> str | None:
    """`zero` when the input range holds an exact 0, `tiny` when its smallest |value| (known
    when the range does not straddle 0) is within rounding of 0 for its dtype, else None."""
    if r.get("has_zero"):
        return "zero"
    lo, hi = json_num(r.get("min"), math.nan), json_num(r.get("max"), math.nan)
    closest = lo if lo >= 0 else -hi if hi <= 0 else math.nan
    if math.isfinite(closest) and closest <= finfo_of(r.get("dtype")).tiny ** 0.5:
        return "tiny"
    return None


def singular_input(ev: Evidence) -> tuple[str, str]:
    """Whether the origin op's input at the singular point is at (or within rounding of) it:
    (`zero` | `tiny` | `no` | `missing`, a phrase for the evidence text). For a division the
    denominator is looked at, for pow / sqrt / rsqrt / norm the base, else any input."""
    ins = ev.inputs
    if not ins:
        return "missing", "the origin op's input ranges were not recorded (no op-level replay)"
    if ev.op.startswith("aten.div") and len(ins) > 1:
        looked, what = [ins[1]], "the denominator"
    elif ev.op.startswith(("aten.reciprocal", *SINGULAR_OPS)):
        looked, what = [ins[0]], "the input"
    else:
        looked, what = ins, "an input"
    for r in looked:
        near = _near_zero(r)
        if near == "zero":
            return "zero", f"{what} holds exact zeros"
        if near == "tiny":
            return "tiny", f"{what} holds values within rounding of 0 (min {r.get('min')})"
    return "no", f"no input is at or near 0 (largest |input| {_fmt(ev.magnitude)})"


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.3g}"


def where_of(ev: Evidence) -> str:
    f = ev.first_nonfinite or {}
    module = f.get("module")
    at = f" in `{module}`" if module else ""
    return f"{f.get('op') or 'an op'}{at} ({f.get('phase') or '?'} phase, step {f.get('step')})"


def recovery_clause(ev: Evidence) -> str:
    """The fix's last clause: how this user turns on nanguard's own recovery, or, when a
    recovery policy already acted in this run, that it did (not a second proposal)."""
    done = sorted({str(a.get("action")) for a in ev.actions} & set(_RECOVERY))
    if done:
        return f"nanguard's recovery acted in this run ({', '.join(done)}: see its actions)"
    if ev.entry == "run":
        return "or let nanguard recover: `nanguard run --policy rollback <your script> ...`"
    return "or let nanguard recover: `Guard(..., policy='rollback')`"


_RECOVERY = ("skip", "rollback", "heal_clip", "wd_cut", "lr_cut")
"""Actions of nanguard's recovery policies (report.json `actions`; `record.report.RECOVERING`)."""


def first_jump(ev: Evidence) -> dict[str, Any] | None:
    """The first one-step growth of the loss or grad norm by >= `JUMP` (finite values, after
    an update) in the steps up to the failure: `step` (where it showed), `from`, `signal`,
    `before`, `after`, `ratio`, and `growth` (the per-step growth of the error it implies: the
    grad norm's ratio, or the square root of a loss ratio)."""
    steps = sorted(ev.steps_until_failure(), key=lambda h: h.get("step", 0))
    for i, (a, b) in enumerate(zip(steps, steps[1:], strict=False)):
        found: list[tuple[float, dict[str, Any]]] = []
        for signal, floor in (("grad_norm", 0.0), ("loss", 1e-3)):
            x, y = json_num(a.get(signal), math.nan), json_num(b.get(signal), math.nan)
            if (math.isfinite(x) and math.isfinite(y) and abs(x) > floor and y / x >= JUMP
                    and not _back_next(steps, i + 1, signal, x)):
                ratio = y / x
                growth = ratio if signal == "grad_norm" else math.sqrt(ratio)
                found.append((growth, {"step": b.get("step"), "from": a.get("step"),
                                       "signal": signal, "before": x, "after": y,
                                       "ratio": ratio, "growth": growth}))
        if found:
            best = max(found, key=lambda f: f[0])[1]
            best["others"] = [f[1] for f in found if f[1] is not best]
            return best
    return None


def _back_next(steps: list[dict[str, Any]], k: int, signal: str, before: float) -> bool:
    """The value jumped at `steps[k]` and was back within 3x of `before` one step later: a
    batch made it, not the training (an error the optimizer fed back does not vanish in one
    update). Unknown (no next step recorded, or not the next step): False."""
    if k + 1 >= len(steps) or steps[k + 1].get("step") != steps[k].get("step", 0) + 1:
        return False
    after = json_num(steps[k + 1].get(signal), math.nan)
    return math.isfinite(after) and abs(after) <= 3 * abs(before)


def transient_jump(ev: Evidence) -> dict[str, Any] | None:
    """The first one-step loss jump (>= `JUMP`) back within 3x of its level at the next step,
    on a run that never went non-finite: `step`, `before`, `after`, `next`."""
    if ev.first_nonfinite is not None:
        return None
    steps = sorted(ev.steps_until_failure(), key=lambda h: h.get("step", 0))
    for k in range(1, len(steps)):
        a, b = steps[k - 1], steps[k]
        x, y = json_num(a.get("loss"), math.nan), json_num(b.get("loss"), math.nan)
        if (math.isfinite(x) and math.isfinite(y) and abs(x) > 1e-3 and y / x >= JUMP
                and b.get("step") == a.get("step", 0) + 1 and _back_next(steps, k, "loss", x)):
            return {"step": b.get("step"), "before": x, "after": y,
                    "next": json_num(steps[k + 1].get("loss"), math.nan)}
    return None


def preflight_init(ev: Evidence) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The layers the preflight flagged as initialised too large, and the one the failure is
    in: the failing module itself (names may carry a prefix: several roots), else the first
    flagged layer inside it."""
    flagged = [f for f in (ev.preflight or {}).get("findings") or []
               if f.get("code") == "exploding_init"]
    module = str((ev.first_nonfinite or {}).get("module") or "")
    if not module:
        return flagged, None
    for f in flagged:
        name = str(f.get("location") or "")
        if name and (module == name or module.endswith("." + name)):
            return flagged, f
    for f in flagged:
        name = str(f.get("location") or "")
        if name.startswith(module + ".") or module.endswith("." + name.split(".")[0]):
            return flagged, f
    return flagged, None


def ordinary_before(ev: Evidence) -> str | None:
    """The step before the failure had ordinary magnitudes (grad norm / activation abs-max
    measured, finite and below `HUGE`): what it measured, else None."""
    step = ev.step
    if step is None:
        return None
    before = [h for h in ev.history if h.get("step") == step - 1]
    for h in before:
        seen = [(label, json_num(h.get(key), math.nan)) for key, label in
                (("grad_norm", "grad norm"), ("act_max", "activation abs-max"))]
        seen = [(label, v) for label, v in seen if math.isfinite(v)]
        if seen and all(v < HUGE for _, v in seen):
            return ", ".join(f"{label} {v:.3g}" for label, v in seen) + f" at step {step - 1}"
    return None


def origin_args(ev: Evidence) -> dict[str, Any]:
    """The origin op's non-tensor arguments (`first_nonfinite.args`, `pinpoint.op_args`)."""
    got = (ev.first_nonfinite or {}).get("args")
    return got if isinstance(got, dict) else {}


def at_line(ev: Evidence) -> str:
    """` at FILE:LINE` of the origin op (the user's line), or "" when unknown."""
    src = (ev.first_nonfinite or {}).get("source")
    return f" at {src}" if src else ""
