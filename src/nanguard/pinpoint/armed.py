"""Arm the checker at a given step of a whole script: zero-code pinpointing.

When the tool cannot call the failing step itself (a script run by `nanguard run`), the script
is re-run deterministically and the checker is armed by global hooks: optimizer steps are
counted by a global step post-hook, the checker is entered right after step N-1's post-hook (at
once for N == 0) and left after step N's post-hook. Global module forward hooks give phases and
module names; the model is discovered as it runs.

    with armed(first_nonfinite_step) as a:
        train(seed)              # unchanged training code
    print(a.origin)
"""

from __future__ import annotations

from collections.abc import Iterator
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

from nanguard.pinpoint.attribution import Attribution
from nanguard.pinpoint.checker import NonfiniteChecker
from nanguard.pinpoint.origin import Origin


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
    _checker: NonfiniteChecker | None = field(default=None, repr=False)


@contextmanager
def armed(step: int, *, model: nn.Module | None = None, rank: int = 0) -> Iterator[Armed]:
    """Run the enclosed code with the checker active during optimizer step `step` (0-based).

    Args:
        step: index of the step to check: the number of optimizer steps completed before it,
            counted from entering the context (all optimizers together; one per step).
        model: optional, for module names; None discovers models as they run.
        rank: written into the origin.

    Yields:
        An `Armed` record; `origin` is filled in when the step's post-hook runs (or when the
        context exits in the middle of the step, e.g. on an exception).
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    state = Armed(step=step)
    attr = Attribution(model=model).install()
    handles: list[RemovableHandle] = []

    def arm() -> None:
        checker = NonfiniteChecker(attr, step=step, rank=rank)
        attr.seen_forward = attr.seen_backward = False
        attr.batch_size = None
        checker.__enter__()
        state._checker, state.ran = checker, True

    def disarm() -> None:
        checker = state._checker
        if checker is None:
            return
        state._checker = None
        checker.__exit__(None, None, None)
        state.origin, state.ops_seen = checker.origin, checker.ops_seen

    def pre(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        attr.optimizer_pre(optimizer)

    def post(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        attr.optimizer_post(optimizer)
        state.steps_seen += 1
        if state.steps_seen == step + 1:
            disarm()
        elif state.steps_seen == step:
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
        attr.remove()
