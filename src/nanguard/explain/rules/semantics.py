"""The op table: causes from what the located op *is* (shared/DESIGN.md section 10).

For the op the checker located (it made a non-finite value from finite or intended inputs),
its tensor inputs' ranges and its non-tensor arguments (`first_nonfinite.args`) name the
mechanism: a domain error (sqrt / rsqrt / a fractional pow of a negative base, acos / asin /
atanh / acosh outside their domain), an overflow of finite values (pow, matmul, sums, mul),
an overflow on narrowing (a cast to a narrower dtype, a tensor made from Python or NumPy
numbers), and arithmetic on values already infinite (0 * inf, inf - inf, inf / inf). Logs,
divisions, softmax, exp and the backward of sqrt / norm / pow at 0 have rules of their own
(`ops`, `division`); `known_op` says whether any rule knows an op, so `undetermined` can say
that an op is not in the table.
"""

from __future__ import annotations

import math

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.fixes import below_one, find_flag
from nanguard.explain.rules.common import (
    LOW_PRECISION,
    at_line,
    finfo_of,
    json_num,
    origin_args,
    where_of,
)
from nanguard.explain.rules.division import DIV_OPS, STD_OPS

_DOMAIN: dict[str, tuple[str, str]] = {
    "aten.sqrt": ("sqrt of a negative value", "`torch.sqrt(x.clamp_min(0))`; if x is a "
                  "variance computed as `E[x^2] - E[x]^2`, use `x.var()` (it cannot go "
                  "below 0 by rounding)"),
    "aten.rsqrt": ("rsqrt of a negative value", "`torch.rsqrt(x.clamp_min(1e-12))`"),
    "aten.pow": ("a fractional power of a negative base", "`x.clamp_min(0) ** p`, or "
                 "`x.abs() ** p * x.sign()` if the sign should be kept"),
    "aten.acos": ("acos outside [-1, 1]", "`torch.acos(x.clamp(-1 + 1e-7, 1 - 1e-7))` (a "
                  "cosine that rounding pushed past 1)"),
    "aten.asin": ("asin outside [-1, 1]", "`torch.asin(x.clamp(-1 + 1e-7, 1 - 1e-7))`"),
    "aten.atanh": ("atanh at or beyond +-1", "`torch.atanh(x.clamp(-1 + 1e-6, 1 - 1e-6))` "
                   "(e.g. the inverse of a tanh-squashed action that reached +-1)"),
    "aten.acosh": ("acosh below 1", "`torch.acosh(x.clamp_min(1 + 1e-6))`"),
}


def _base(op: str) -> str:
    """`aten.pow.Tensor_Scalar` -> `aten.pow`: the overload packet the table is keyed by."""
    return ".".join(op.split(".")[:2])


def _outside(op: str, lo: float, hi: float, exponent: object) -> bool:
    if op in ("aten.sqrt", "aten.rsqrt"):
        return lo < 0
    if op == "aten.pow":
        frac = isinstance(exponent, float) and not float(exponent).is_integer()
        return lo < 0 and (frac or exponent is None)
    if op in ("aten.acos", "aten.asin"):
        return lo < -1 or hi > 1
    if op == "aten.atanh":
        return lo <= -1 or hi >= 1
    return lo < 1  # acosh


def domain_error(ev: Evidence) -> Cause | None:
    """Needs: origin op (forward or loss, not backward) sqrt / rsqrt / pow / acos / asin /
    atanh / acosh with its input (the base) outside the op's domain: below 0; a negative base
    with a fractional exponent (`exponent` argument, or a tensor exponent); beyond [-1, 1];
    at or beyond +-1; below 1. Ruled out: an input inside the domain, no input ranges, the
    backward (singular_gradient)."""
    op = _base(ev.op)
    if op not in _DOMAIN or ev.phase in ("backward", "optimizer") or not ev.inputs:
        return None
    scalar = origin_args(ev).get("self")  # `pow.Scalar`: a Python base, the tensor is the exponent
    if isinstance(scalar, (int, float)) and not isinstance(scalar, bool):
        lo = hi = float(scalar)
    else:
        first = ev.inputs[0]
        lo, hi = json_num(first.get("min"), math.nan), json_num(first.get("max"), math.nan)
    if math.isnan(lo) or not _outside(op, lo, hi, origin_args(ev).get("exponent")):
        return None
    what, fix = _DOMAIN[op]
    exp = origin_args(ev).get("exponent")
    extra = f", exponent {exp}" if exp is not None else ""
    return Cause(
        cause="domain_error",
        confidence=0.9,
        evidence=f"{where_of(ev)}{at_line(ev)}: {what}: its input ranges over "
        f"[{lo:.4g}, {hi:.4g}]{extra}",
        fix=f"at that line: {fix}",
    )


_CAST_OPS = ("aten._to_copy", "aten.to", "aten.copy_", "aten.copy", "aten.lift_fresh",
             "aten.lift_fresh_copy", "aten._convert_element_type", "aten.type_as")


def cast_overflow(ev: Evidence) -> Cause | None:
    """Needs: origin op a cast or a tensor creation (`_to_copy` to the `dtype` argument,
    `copy_` into a narrower tensor, `lift_fresh` of `torch.tensor(numbers)`) with an Inf
    output and a finite input whose magnitude exceeds the output dtype's largest value (for a
    tensor made from Python / NumPy numbers, the input is their float64 range, recorded where
    the tensor entered). Ruled out: an input the output dtype holds, an input already
    non-finite (the value came in non-finite: another rule names where)."""
    if not ev.op.startswith(_CAST_OPS) or not ev.inputs:
        return None
    out = (ev.first_nonfinite or {}).get("output") or {}
    dtype = str(out.get("dtype") or origin_args(ev).get("dtype") or "")
    top = ev.magnitude
    src = ev.inputs[0]
    if not out.get("inf") or top is None or src.get("nonfinite") or not dtype:
        return None
    largest = finfo_of(dtype).max
    if top <= largest:
        return None
    entered = (ev.first_nonfinite or {}).get("entered") or {}
    made = ev.op.startswith("aten.lift_fresh") or entered.get("how") in ("tensor", "numpy")
    what = ("a tensor made from Python numbers (`torch.tensor(...)`)" if made
            else f"a cast from {src.get('dtype')} to {dtype}")
    fix = (f"the numbers reach {top:.3g} before they become a {dtype} tensor: find why they "
           "grow that large (a sum with a factor above 1, e.g. a discount factor > 1; "
           "unnormalised rewards or targets) and scale or clip them first "
           f"(`torch.tensor(x, dtype=torch.float64)` then normalise, then `.to(torch.{dtype})`)"
           if made else
           f"normalise or clip before the cast: `x.clamp(-{largest:.3g}, {largest:.3g})"
           f".to(torch.{dtype})`, or keep this value in {src.get('dtype')}")
    gamma = find_flag(ev.argv, "gamma") if made else None
    if gamma is not None and gamma.value > 1:
        # A discount factor above 1 grows a return geometrically with the episode's length.
        meant = below_one(gamma)
        fix = (f"{gamma.now()} is a discount factor above 1: each step back multiplies the "
               f"return by {gamma.text}, and a long episode's return passes {dtype}'s range; "
               + (f"did you mean {gamma.with_text(meant)}?" if meant else "keep it below 1"))
    if entered.get("file"):
        fix += (f"; the values were read from {entered['file']}: `nanguard scan "
                f"{entered['file']}` lists the rows beyond {largest:.3g}")
    return Cause(
        cause="cast_overflow",
        confidence=0.93,
        evidence=f"{where_of(ev)}{at_line(ev)}: {what}: its values reach {top:.3g}, beyond "
        f"{dtype}'s largest {largest:.4g}, and became inf on narrowing",
        fix=f"at that line: {fix}",
    )


_OVERFLOW_OPS: dict[str, str] = {
    "aten.pow": "clamp the base (`x.clamp(-c, c) ** p`) or work in log space "
                "(`p * torch.log(x)`)",
    "aten.mul": "scale the factors down first (normalise them)",
    "aten.square": "scale the input down first (normalise it)",
    "aten.add": "scale the terms down first (normalise them)",
    "aten.sub": "scale the terms down first (normalise them)",
    "aten.sum": "accumulate in float64 (`x.double().sum()`) or average / normalise first",
    "aten.cumsum": "accumulate in float64 or normalise first",
    "aten.mean": "accumulate in float64 or normalise first",
    "aten.prod": "sum logs instead (`x.log().sum()`)",
    "aten.linalg_vector_norm": "scale before the norm (`(x / s).norm() * s`)",
    "aten.norm": "scale before the norm (`(x / s).norm() * s`)",
}
_MATMUL_OPS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.matmul", "aten.baddbmm",
               "aten.linear", "aten.addmv", "aten.mv", "aten.dot", "aten.convolution",
               "aten._scaled_dot_product")
_MATMUL_FIX = ("find why the inputs grew (the grad-norm history, the LR), normalise the "
               "activations before this layer (a LayerNorm), or clip the gradients")


def arithmetic_overflow(ev: Evidence) -> Cause | None:
    """Needs: origin op pow / mul / add / sum / prod / a norm / a matmul or convolution in
    forward or loss, every input finite and the output Inf (or NaN from Inf partial sums)
    in a dtype with float32's range. It names the op's mechanism only, at a low confidence:
    why the magnitudes were that large is the dynamics rules' (exploding_init,
    optimizer_divergence), which outrank it. Ruled out: a non-finite input (the value came
    in), float16 (low_precision_overflow), no input ranges, the backward / optimizer."""
    base = _base(ev.op)
    fix = _OVERFLOW_OPS.get(base) or (_MATMUL_FIX if base.startswith(_MATMUL_OPS) else None)
    if fix is None or ev.phase not in ("forward", "loss", "data") or not ev.inputs:
        return None
    if any(i.get("nonfinite") for i in ev.inputs) or str(ev.dtype) in LOW_PRECISION:
        return None
    top = ev.magnitude
    if top is None:
        return None
    exp = origin_args(ev).get("exponent")
    extra = f" to the power {exp}" if exp is not None else ""
    return Cause(
        cause="arithmetic_overflow",
        confidence=0.45,
        evidence=f"{where_of(ev)}{at_line(ev)}: finite inputs up to |x| = {top:.3g}{extra} "
        f"overflowed {ev.dtype or 'float32'} (largest {finfo_of(ev.dtype).max:.3g})",
        fix=f"at that line: {fix}",
    )


def _has_inf(i: dict[str, object], sign: int) -> bool:
    key = "min" if sign < 0 else "max"
    return json_num(i.get(key), 0.0) == sign * math.inf


def inf_arithmetic(ev: Evidence) -> Cause | None:
    """Needs: origin op mul / sub / add / div / sum with a NaN output made from inputs that
    already held Inf the checker did not count as a failure (a mask of -inf, a constant):
    0 * inf (an input at 0 and an input holding Inf), inf - inf (opposite infinities across
    the operands of a sub, the same sign for an add-of-opposites, both in a sum), inf / inf.
    Ruled out: no input holds Inf, an op not among these."""
    base = _base(ev.op)
    out = (ev.first_nonfinite or {}).get("output") or {}
    ins = ev.inputs
    if not out.get("nan") or not any(_has_inf(i, 1) or _has_inf(i, -1) for i in ins):
        return None
    if base == "aten.mul" and any(i.get("has_zero") for i in ins):
        what = "0 * inf"
        fix = ("don't multiply by a mask that holds inf (or a factor that is 0 where the other "
               "is inf): `x.masked_fill(~keep, 0)` or `torch.where(keep, x, 0)` instead of "
               "`x * mask`; fill masks with `torch.finfo(x.dtype).min`, not -inf")
    elif base in ("aten.sub", "aten.add", "aten.sum", "aten.mean", "aten.rsub"):
        what = "inf - inf"
        fix = ("subtract only finite values (a row whose max is -inf is fully masked: "
               "`x - x.amax(dim, keepdim=True).clamp_min(torch.finfo(x.dtype).min)`), or fill "
               "masks with `torch.finfo(x.dtype).min` instead of -inf")
    elif base.startswith(DIV_OPS) and len(ins) > 1 and all(
            _has_inf(i, 1) or _has_inf(i, -1) for i in ins[:2]):
        what = "inf / inf"
        fix = "keep numerator and denominator finite (a masked value divided by a masked sum)"
    else:
        return None
    return Cause(
        cause="inf_arithmetic",
        confidence=0.85,
        evidence=f"{where_of(ev)}{at_line(ev)}: {what} = NaN; an input already held inf that "
        "was made on purpose (a mask or a constant), not by a failing op",
        fix=f"at that line: {fix}",
    )


_KNOWN = (*_DOMAIN, *_CAST_OPS, *_OVERFLOW_OPS, *_MATMUL_OPS, *DIV_OPS, *STD_OPS,
          "aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy", "aten.exp",
          "aten.expm1", "aten._softmax", "aten.softmax", "aten._log_softmax",
          "aten.log_softmax", "aten._safe_softmax", "aten.logsumexp", "aten.rsub",
          "aten.binary_cross_entropy", "aten.mse_loss", "aten.l1_loss", "aten.nll_loss",
          "aten.smooth_l1_loss", "aten.huber_loss", "aten.cross_entropy", "aten.kl_div",
          "aten.sqrt_backward", "aten.set_", "aten.from_file")


def known_op(op: str) -> bool:
    """Whether the op table has a mechanism for `op` (an aten name, overload or not)."""
    base = _base(op)
    return base in _KNOWN or base.startswith(("aten._foreach", "aten.native_batch_norm",
                                               "aten.native_layer_norm"))
