"""Arm the checker at a given step of a whole script: zero-code pinpointing.

When the tool cannot call the failing step itself (a script run by `nanguard run`), the script
is re-run deterministically and the checker is armed by global hooks: optimizer steps are
counted by a global step post-hook, the checker is entered right after step N-1's post-hook (at
once for N == 0) and left after step N's post-hook. Global module forward hooks give phases and
module names; the model is discovered as it runs.

A script with no optimizer (hand-written updates) gets its step boundaries from `backward()`
exactly as `nanguard run` counted them (`run.manual.ManualBoundaries`). Such a step
ends only at the next backward, after the next forward (raw tensors: no module marks where a
forward begins), so for step N the checker is entered before step N-1's update and leaves the
optimizer phase at the first grad-enabled op on a trained tensor (the forward of step N).
Ops run by a closure inside `optimizer.step(closure)` (LBFGS) get the phase of what they are
(forward, loss, backward), not `optimizer`: the global pre-hook wraps the closure and lifts the
optimizer phase while it runs.

`reproduced` is set on the origin: with an expected loss (`expect_loss`, or the environment
variable NANGUARD_EXPECT_LOSS that `nanguard run` sets for its re-run), whether the loss
backpropagated in the armed step equals it bit for bit (NaN equals NaN); else whether the step
went non-finite again. `nanguard run` records a loss scaled for its backward (`loss / accum`,
`scaler.scale(loss)`) in the script's units, so the backpropagated value is compared with its
scalings undone too (`loss_expr.unscalings`): otherwise every accumulating script's re-run
would read as non-deterministic.

    with armed(first_nonfinite_step) as a:
        train(seed)              # unchanged training code
    print(a.origin)
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from nanguard.pinpoint import loss_expr
from nanguard.pinpoint.attribution import Attribution
from nanguard.pinpoint.checker import NonfiniteChecker
from nanguard.pinpoint.origin import Origin
from nanguard.run.manual import ManualBoundaries, ManualStep


@dataclass(kw_only=True)
class Armed:
    """What `armed` saw: the origin (None if step N ran clean or never came)."""

    step: int
    origin: Origin | None = None
    steps_seen: int = 0
    """Optimizer steps completed while armed (counted from entering the context)."""
    ran: bool = False
    """The checker was active for step `step` (the script got that far)."""
    ops_seen: int = 0
    loss: float | None = None
    """The last scalar backpropagated during the armed step (read once, when it ends)."""
    losses: list[float] = field(default_factory=list)
    """`loss`, then the same value with the constant scalings of its backward undone (the
    units a guard may have recorded it in)."""
    _checker: NonfiniteChecker | None = field(default=None, repr=False)


@contextmanager
def armed(step: int, *, model: nn.Module | None = None, rank: int = 0,
          expect_loss: float | None = None) -> Iterator[Armed]:
    """Run the enclosed code with the checker active during optimizer step `step` (0-based).

    Args:
        step: index of the step to check: the number of optimizer steps completed before it,
            counted from entering the context (all optimizers together; one per step).
        model: optional, for module names; None discovers models as they run.
        rank: written into the origin.
        expect_loss: the loss the original run recorded at that step: `origin.reproduced`
            then says whether the re-run's loss equals it bit for bit. None reads
            NANGUARD_EXPECT_LOSS (set by `nanguard run`); absent, `reproduced` says whether the
            step went non-finite again.

    Yields:
        An `Armed` record; `origin` is filled in when the step's post-hook runs (or when the
        context exits in the middle of the step, e.g. on an exception).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if expect_loss is None and os.environ.get("NANGUARD_EXPECT_LOSS"):
        try:
            expect_loss = float(os.environ["NANGUARD_EXPECT_LOSS"])
        except ValueError:
            expect_loss = None
    state = Armed(step=step)
    attr = Attribution(model=model).install()
    manual = ManualBoundaries(roots=lambda: list(attr.roots)).install()
    handles: list[RemovableHandle] = []
    loss_seq = [0]
    scaled: list[list[loss_expr.Scaled]] = [[]]

    def saw_loss(tensor: torch.Tensor) -> None:
        # Read before the backward frees the graph's saved constants; only while armed.
        if state._checker is not None:
            try:
                scaled[0] = loss_expr.scalings(tensor)
            except Exception:  # noqa: BLE001 - never in the script's way: compared raw only
                scaled[0] = []

    manual.on_loss = saw_loss

    def arm() -> None:
        checker = NonfiniteChecker(attr, step=step, rank=rank)
        attr.seen_forward = attr.seen_backward = False
        attr.batch_size = None
        loss_seq[0] = manual.loss_seq
        checker.__enter__()
        state._checker, state.ran = checker, True

    def disarm() -> None:
        checker = state._checker
        if checker is None:
            return
        state._checker = None
        checker.__exit__(None, None, None)
        state.origin, state.ops_seen = checker.origin, checker.ops_seen
        if manual.loss_seq > loss_seq[0] and manual.last_loss is not None:
            last = manual.last_loss.reshape(-1)[0]
            state.loss = float(last)
            state.losses = [state.loss] + [
                float(v) for v in loss_expr.unscalings(last, scaled[0])]
        if state.origin is not None:
            state.origin.reproduced = _reproduced(state.losses, expect_loss)

    def pre(optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        attr.optimizer_pre(optimizer)
        if (isinstance(optimizer, ManualStep) and state.steps_seen == step - 1
                and state._checker is None):
            # A hand-written step ends at the next backward, after the next forward (raw
            # tensors: no module marks where that begins): armed before this update instead,
            # so that forward is seen. The checker leaves the optimizer phase at the
            # forward's first op; this update's own ops are checked (they were finite).
            arm()
            assert state._checker is not None
            state._checker.scan_state(optimizer)
        return _lift_closure(attr, optimizer, args, kwargs)

    def post(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        attr.optimizer_post(optimizer)
        state.steps_seen += 1
        if state.steps_seen == step + 1:
            disarm()
        elif state.steps_seen == step and state._checker is None:
            arm()

    try:
        handles += [register_optimizer_step_pre_hook(pre),
                    register_optimizer_step_post_hook(post)]
        if step == 0:
            arm()
        yield state
    finally:
        disarm()
        for h in handles:
            h.remove()
        manual.remove()
        attr.remove()


def _reproduced(losses: list[float], expected: float | None) -> bool:
    """The armed step failed again; with both losses known, also bit for bit the same loss
    (as backpropagated, or in the units of one of its scalings undone)."""
    if not losses or expected is None:
        return True
    return any((math.isnan(v) and math.isnan(expected)) or v == expected for v in losses)


def _lift_closure(attr: Attribution, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """Wrap `optimizer.step(closure)`'s closure: while it runs (forward, loss, backward of a
    fresh evaluation), the optimizer phase is lifted; it is restored when it returns."""
    in_args = len(args) > 1 and callable(args[1])
    closure: Callable[[], Any] | None = args[1] if in_args else kwargs.get("closure")
    if not callable(closure):
        return None
    inner = closure

    def lifted() -> Any:
        saved = attr.optimizer
        attr.optimizer = None
        attr.seen_forward = attr.seen_backward = False
        try:
            return inner()
        finally:
            attr.optimizer = saved

    if in_args:
        return (args[0], lifted, *args[2:]), kwargs
    return args, {**kwargs, "closure": lifted}
