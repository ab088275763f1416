"""The loss a `backward()` took, as an expression over the losses the recorder saw.

Scripts rarely backpropagate a `torch.nn.functional` loss as it came out: gradient accumulation
divides it (`loss / accum_steps`), a GradScaler multiplies it (`scaler.scale(loss)`), a GAN's
discriminator adds two (`bce(D(real), 1) + bce(D(fake), 0)`), a multi-task model weights them
(`l_main + 0.1 * l_aux`). The tensor handed to `backward()` is then a temporary made of the
recorded losses; the recorded loss values may be temporaries too, already freed. What survives
is the autograd graph, until the backward runs: `parse` walks it from the backpropagated tensor
down to the recorded losses, whose autograd nodes carry a tag (`tag`, in the node's
`metadata`, which lives on the C++ node as long as the graph does), and reads the constants
the nodes saved (a divisor, a weight, a scale) before the backward frees them.

The grammar is small on purpose: sums and differences of two expressions (`AddBackward0`,
`SubBackward0`, with their `alpha`), products with and divisions by a constant that needs no
gradient (`MulBackward0`, `DivBackward0`), and recorded losses. Anything else (a `log` of a
loss, a constant added, `sum([...])` starting from 0) is not an expression here: `parse`
returns None and the step is not replayed in process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

__all__ = ["Combined", "Scaled", "evaluate", "leaves", "parse", "scalings", "tag", "unscale",
           "unscalings"]

TAG = "nanguard.loss"
"""The key of a recorded loss's tag in its autograd node's `metadata` (`id` of the record)."""

_MAX_DEPTH = 16
"""Nodes walked at most: a loss expression is a few operations deep."""

_SCALE_OPS = {"MulBackward0": torch.mul, "DivBackward0": torch.div}


def _metadata(node: Any) -> dict[str, Any]:
    """An autograd node's `metadata` dict (a property; torch's stubs call it a method)."""
    return cast(dict[str, Any], node.metadata)


def tag(value: torch.Tensor, record: object) -> None:
    """Mark `value`'s autograd node as the one of `record` (a recorded loss call). Once per
    recorded loss: one node object made, one dict entry."""
    node = value.grad_fn
    if node is not None:
        _metadata(node)[TAG] = id(record)


@dataclass(eq=False)
class Scaled:
    """`inner * other` or `inner / other`, `other` a constant tensor (that needs no gradient)."""

    inner: Any
    op: Any
    other: torch.Tensor
    number: bool
    """`other` is a Python number the script wrote: autograd saved it as a 0-dim float64 /
    int64 CPU tensor, which would promote the loss if given back as it is. It is cast to the
    loss's dtype instead, as PyTorch casts a number (read with no `.item()`: a replay runs
    under a dispatch mode, and `.item()` of such a tensor fails there)."""


@dataclass(eq=False)
class Combined:
    """`a + alpha * b` (or `a - alpha * b`)."""

    a: Any
    b: Any
    alpha: float
    sub: bool


def parse(tensor: torch.Tensor, records: list[Any]) -> Any:
    """`tensor` as an expression over `records` (recorded losses, tagged by `tag`), or None.
    Must be asked before `tensor.backward()` runs: the constants are saved tensors."""
    by_id = {id(r): r for r in records}
    return _parse(tensor.grad_fn, by_id, 0, tensor.dtype) if by_id else None


def _is_number(saved: torch.Tensor, dtype: torch.dtype) -> bool:
    """A saved constant that was a Python number: 0-dim, CPU, float64 / int64, not the loss's
    dtype."""
    return (saved.dim() == 0 and saved.device.type == "cpu" and dtype != saved.dtype
            and saved.dtype in (torch.float64, torch.int64))


def _parse(node: Any, by_id: dict[int, Any], depth: int, dtype: torch.dtype) -> Any:
    if node is None or depth > _MAX_DEPTH:
        return None
    found = _metadata(node).get(TAG)
    if found is not None:
        return by_id.get(found)
    name = type(node).__name__
    nxt = node.next_functions
    if len(nxt) != 2:
        return None
    (a, _), (b, _) = nxt
    if name in ("AddBackward0", "SubBackward0"):
        if a is None or b is None:
            return None  # a constant added: not saved, its value unknown
        left, right = _parse(a, by_id, depth + 1, dtype), _parse(b, by_id, depth + 1, dtype)
        if left is None or right is None:
            return None
        return Combined(left, right, float(getattr(node, "_saved_alpha", 1)),
                        name == "SubBackward0")
    op = _SCALE_OPS.get(name)
    if op is None:
        return None
    # The loss on one side, a constant (no gradient) on the other; `k / loss` is no scaling.
    if b is None and a is not None:
        inner_node, saved = a, "_saved_other"
    elif a is None and b is not None and op is torch.mul:
        inner_node, saved = b, "_saved_self"
    else:
        return None
    inner = _parse(inner_node, by_id, depth + 1, dtype)
    other = getattr(node, saved, None)
    if inner is None or not isinstance(other, torch.Tensor):
        return None
    return Scaled(inner, op, other, _is_number(other, dtype))


def leaves(expr: Any) -> list[Any]:
    """The recorded losses of `expr`, left to right."""
    if isinstance(expr, Scaled):
        return leaves(expr.inner)
    if isinstance(expr, Combined):
        return leaves(expr.a) + leaves(expr.b)
    return [expr]


def evaluate(expr: Any, value_of: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    """`expr` computed again, each recorded loss by `value_of(record)`."""
    if isinstance(expr, Scaled):
        inner = evaluate(expr.inner, value_of)
        other = expr.other.to(inner.dtype) if expr.number else expr.other
        return cast(torch.Tensor, expr.op(inner, other))
    if isinstance(expr, Combined):
        a, b = evaluate(expr.a, value_of), evaluate(expr.b, value_of)
        if expr.alpha == 1:
            return a - b if expr.sub else a + b
        return torch.sub(a, b, alpha=expr.alpha) if expr.sub else torch.add(a, b, alpha=expr.alpha)
    return value_of(expr)


def unscale(expr: Any, value: torch.Tensor) -> torch.Tensor | None:
    """`value` (of `expr`, detached) in the units of its one recorded loss, when `expr` is that
    loss scaled (`loss / accum_steps`, `scaler.scale(loss)`): the loss series a guard records
    then reads as the script's loss, not as its scaled copy. None for anything else (a sum of
    losses, or the loss itself)."""
    if not isinstance(expr, Scaled):
        return None
    with torch.no_grad():
        while isinstance(expr, Scaled):
            other = expr.other.to(value.dtype) if expr.number else expr.other
            value = value * other if expr.op is torch.div else value / other
            expr = expr.inner
    return None if isinstance(expr, Combined) else value


def scalings(tensor: torch.Tensor) -> list[Scaled]:
    """The products with and divisions by a constant at the top of `tensor`'s graph, outermost
    first (`loss / accum`, `scaler.scale(loss)`, `0.5 * loss`), each with `inner` None: what
    `unscalings` undoes. For a re-run that has no recorded losses to parse against (the
    zero-code re-run, `pinpoint.armed`). Must be asked before `tensor.backward()` runs."""
    found: list[Scaled] = []
    node = tensor.grad_fn
    while node is not None and len(found) < _MAX_DEPTH:
        op = _SCALE_OPS.get(type(node).__name__)
        nxt = node.next_functions
        if op is None or len(nxt) != 2:
            break
        (a, _), (b, _) = nxt
        if b is None and a is not None:
            node, other = a, getattr(node, "_saved_other", None)
        elif a is None and b is not None and op is torch.mul:
            node, other = b, getattr(node, "_saved_self", None)
        else:
            break
        if not isinstance(other, torch.Tensor):
            break
        found.append(Scaled(None, op, other, _is_number(other, tensor.dtype)))
    return found


def unscalings(value: torch.Tensor, scaled: list[Scaled]) -> list[torch.Tensor]:
    """`value` (detached) with the first 1, 2, ... of `scaled` (from `scalings`) undone, in
    the arithmetic `unscale` uses: whichever of them a guard recorded as the step's loss."""
    out = []
    with torch.no_grad():
        for s in scaled:
            other = s.other.to(value.dtype) if s.number else s.other
            value = value * other if s.op is torch.div else value / other
            out.append(value)
    return out
