"""What the pre-hook follows before it measures a step: the optimizer's parameters, its LR,
and state loaded since the last update.

Each runs from `StepPipeline.pre_hook` only when its trigger holds (a group added, the LR
changed, a `load_state_dict` seen): never on a quiet step.
"""

from __future__ import annotations

import torch
from torch import nn

from nanguard.recover.loss_after import LossAfter, loss_level
from nanguard.step import build
from nanguard.step.build import Parts
from nanguard.step.state import StepState
from nanguard.watch import loads

__all__ = ["follow_params", "lr_changed", "loaded_flags"]


def follow_params(state: StepState, parts: Parts, model: nn.Module,
                  optimizer: torch.optim.Optimizer) -> None:
    """Follow the optimizer's parameters (`add_param_group` after the guard was built).
    Appending keeps every earlier parameter's index."""
    state.params, state.param_names, state.param_order = build.param_table(model, optimizer)
    parts.probe.follow(state.params)
    parts.store.write_params([(n, tuple(p.shape), p.numel())
                              for n, p in zip(state.param_names, state.params, strict=True)])


def lr_changed(state: StepState, parts: Parts, lr: float | None) -> None:
    """The LR differs from the last step's (or the one a loaded checkpoint carried): a
    jump up without warm-up is an `lr_jump` alarm, said at once (`policy.lr_change`)."""
    jump = parts.recovery.lr_changes.see(state.step, lr)
    if jump is None:
        return
    parts.log.add_alarm(jump.alarm())
    if state.loss_after is None or state.loss_after.what != "resume":
        # (a resume's own check names a jump that came with it)
        level = loss_level(s.loss for s in parts.log.history)
        if level is not None or jump.resumed:
            state.loss_after = LossAfter(level, jump.step, "jump", jump)


def loaded_flags(state: StepState, parts: Parts, optimizer: torch.optim.Optimizer
                 ) -> tuple[list[str], torch.Tensor | None]:
    """Before the first update (and the first after a `load_state_dict`): finiteness flags
    of every parameter, optimizer-state tensor and buffer, riding in that step's packet."""
    if parts.log.finding is not None:
        return [], None
    return loads.finiteness_flags(state.param_names, state.params, optimizer,
                                  parts.buffer_names, parts.probe.buffers)
