"""The division-by-zero rule of the op table: a tensor denominator at (or within rounding of)
0, a Python scalar divisor that is 0 (`x / (n - 1)` with n == 1: not among the op's tensor
inputs, read from its arguments), a `std` / `var` over n <= correction elements (n - correction
is the divisor), and a mean or loss over an empty tensor (0 / 0).
"""

from __future__ import annotations

import math
from typing import Any

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.fixes import find_flag
from nanguard.explain.rules.common import (
    at_line,
    origin_args,
    singular_input,
    singular_node,
    where_of,
)

DIV_OPS = ("aten.div", "aten.reciprocal", "aten._foreach_div", "aten.floor_divide",
           "aten.true_divide", "aten.remainder", "aten.fmod")
"""Ops that divide (a `reciprocal` divides 1 by its input)."""

STD_OPS = ("aten.std", "aten.var", "aten.std_mean", "aten.var_mean")
"""Reductions that divide by n - correction."""


def _empty_input(ev: Evidence) -> dict[str, Any] | None:
    """The origin op's first input with no elements (a dimension of size 0), when its output
    is NaN: a reduction over nothing (a mean, a loss averaged over an empty selection)."""
    out = (ev.first_nonfinite or {}).get("output") or {}
    if not out.get("nan"):
        return None
    return next((i for i in ev.inputs
                 if isinstance(i.get("shape"), list) and 0 in i["shape"]), None)


def _empty_reduction(ev: Evidence, empty: dict[str, Any]) -> Cause:
    shape = empty.get("shape")
    rows = " (0 rows)" if shape and shape[0] == 0 else ""
    return Cause(
        cause="division_by_zero",
        confidence=0.85,
        evidence=f"{where_of(ev)} reduced an empty tensor: input shape {shape}{rows}; the mean "
        "over no elements is 0 / 0 (an empty selection or split of the batch)",
        fix="skip the term when the selection is empty (`if mask.any(): ...`), or average "
        "over a count that cannot be 0: `(per_item * mask).sum() / mask.sum().clamp_min(1)`; "
        "for an empty split, check its size before training on it",
    )


def reduced_count(shape: list[int], dim: object) -> int:
    """How many elements a reduction over `dim` (None / []: all) of a `shape` reduces."""
    if not shape:
        return 1
    if dim is None or dim == []:
        return math.prod(shape)
    dims = dim if isinstance(dim, list) else [dim]
    return math.prod(shape[int(d)] for d in dims if isinstance(d, int) and -len(shape) <= d
                     < len(shape))


def _correction(ev: Evidence) -> Cause | None:
    """`std` / `var` whose n - correction <= 0 (one element with the default correction=1)."""
    if not ev.op.startswith(STD_OPS) or not ev.inputs or ev.phase in ("backward", "optimizer"):
        return None
    args = origin_args(ev)
    corr = args.get("correction")
    if not isinstance(corr, (int, float)) or isinstance(corr, bool):
        corr = 0 if args.get("unbiased") is False else 1  # the default: Bessel's correction
    shape = ev.inputs[0].get("shape")
    if not isinstance(shape, list):
        return None
    n = reduced_count(shape, args.get("dim"))
    if n - corr > 0:
        return None
    name = ev.op.removeprefix("aten.").split(".")[0]
    size = find_flag(ev.argv, "batch_size")
    lead = ""
    if size is not None and size.value == n:
        # The group of one is the batch the user asked for: the flag is the first fix.
        lead = (f"{size.now()} makes batches of {n} row{'s' if n != 1 else ''}: "
                f"set {size.set(int(corr) + 1)} or more, or ")
    return Cause(
        cause="division_by_zero",
        confidence=0.92,
        evidence=f"{where_of(ev)}{at_line(ev)}: `{name}` over n = {n} element"
        f"{'s' if n != 1 else ''} with correction = {corr:g} divides by n - correction = "
        f"{n - corr:g} (input shape {shape}): a group of one (a last minibatch of one "
        "sample, a batch of one row)",
        fix=(f"{lead}at that line take `{name}` only of {int(corr) + 1} values or more, or use "
             f"`x.{name}(correction=0)`") if lead else (
            f"at that line, never take `{name}` of fewer than {int(corr) + 1} values: guard "
            f"the size (`x.{name}() if x.numel() > 1 else x.new_zeros(())`, or normalise "
            f"advantages only when the minibatch holds more than one), use `x.{name}("
            "correction=0)`, or drop the short last minibatch (`drop_last=True`, a rollout size "
            "that the minibatch size divides)"),
    )


def _scalar_divisor(ev: Evidence) -> Cause | None:
    """A division whose divisor is a Python number equal to 0 (`other` in the arguments)."""
    other = origin_args(ev).get("other")
    if isinstance(other, bool) or not isinstance(other, (int, float)) or other != 0:
        return None
    num = "0 / 0 = NaN" if _zero_numerator(ev) else "x / 0 = inf"
    return Cause(
        cause="division_by_zero",
        confidence=0.93,
        evidence=f"{where_of(ev)}{at_line(ev)} divided by the Python scalar {other!r} (not a "
        f"tensor: a size or count the code computed, e.g. `n - 1` with n = 1): {num}",
        fix="at that line the divisor is a Python number that is 0 for this configuration: "
        "guard it (`max(n - 1, 1)`, or branch for n == 1) or reject the flag value that makes "
        "it 0 when parsing the arguments",
    )


def _zero_numerator(ev: Evidence) -> bool:
    return bool(ev.inputs) and bool(ev.inputs[0].get("has_zero"))


def division_by_zero(ev: Evidence) -> Cause | None:
    """Needs: origin op a division (not in the optimizer, not inside a singular node's
    backward) whose denominator holds zeros or values within rounding of 0, or whose divisor
    is a Python scalar 0 (its `other` argument); a `std` / `var` over n <= correction
    elements (`correction` / `unbiased` and `dim` from its arguments, n from the input's
    shape); or any op that made a NaN out of an input with no elements (a mean or a loss over
    an empty selection: 0 / 0). Ruled out: a denominator range away from 0 and a nonzero
    scalar divisor (a huge numerator overflowed instead), n > correction, an empty input with
    a finite or Inf output. Without input ranges it fires lower (not in backward:
    singular_gradient), saying so."""
    if ev.phase != "optimizer" and (empty := _empty_input(ev)) is not None:
        return _empty_reduction(ev, empty)
    if (found := _correction(ev)) is not None:
        return found
    if not ev.op.startswith(DIV_OPS):
        return None
    if ev.phase == "optimizer" or singular_node(ev):
        return None  # optimizer_state_nonfinite / singular_gradient explain it better
    if (found := _scalar_divisor(ev)) is not None:
        return found
    if "other" in origin_args(ev):
        return None  # a nonzero scalar divisor: the numerator overflowed
    at, phrase = singular_input(ev)
    if at == "no" or (at == "missing" and ev.phase == "backward"):
        return None
    conf = {"zero": 0.85, "tiny": 0.8}.get(at, 0.5)
    return Cause(
        cause="division_by_zero",
        confidence=conf,
        evidence=f"{where_of(ev)}{at_line(ev)} divided by zero: {phrase}",
        fix="add an eps to the denominator at that line: `x / (std + 1e-5)` or "
        "`x / d.clamp_min(1e-12)`",
    )
