"""What the step pipeline keeps between steps (`StepState`), and the facts of the run it is
told when it is built (`RunFacts`).

`StepState` is every value the pipeline changes while training runs, declared in one place: a
newcomer reads here what a step can leave behind for the next one. Of it, `step`,
`grad_baseline` and `loss_after` travel in `Guard.state_dict` (`guard_state`); the rest is
rebuilt by the first step after a resume.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from nanguard.pinpoint.baseline import GradBaseline
from nanguard.recover.loss_after import LossAfter
from nanguard.recover.verdict import LossWatch
from nanguard.watch.lane import LaneStep
from nanguard.watch.stats import StepStats
from nanguard.watch.step import Pending

__all__ = ["RunFacts", "StepState"]


@dataclasses.dataclass(kw_only=True)
class RunFacts:
    """How nanguard was started, for the diagnosis to word its fixes (`Guard(facts=...)`).

    Given when the guard is built. The zero-code runner shares one object among the guards of
    a script and notes there the script's clip when the script calls `clip_grad_norm_`
    (it may do so only after its optimizers exist).
    """

    entry: str = "api"
    """`api` (the Guard in the user's loop), `run` (`nanguard run`), `lightning` or
    `transformers`: the diagnosis words its fixes for that entry point."""
    script_clip: float | None = None
    """The `max_norm` of the script's own `clip_grad_norm_` (0 when its flag turned it off;
    None: not known); the diagnosis weighs its fixes by it."""
    preflight: dict[str, Any] | None = None
    """`nanguard run --preflight`: its verdict."""
    script_argv: list[str] = dataclasses.field(default_factory=lambda: list(sys.argv[1:]))
    """The command line the training script was started with (a fix names the flag that set
    the value it changes: `--lr 0.05` -> `--lr 0.005`)."""

    def as_log(self) -> dict[str, Any]:
        """The facts as `Guard.run_log()` carries them."""
        return {"script_clip": self.script_clip, "entry": self.entry,
                "preflight": self.preflight, "script_argv": self.script_argv}


@dataclasses.dataclass(kw_only=True)
class StepState:
    """Everything the step pipeline carries from one step to the next (see the module
    docstring). Built once, before the first step; changed only by the step package's
    modules (`pipeline`, `before`, `judging`, `keeping`, `acting`), to which it is passed."""

    step: int = 0
    """Optimizer steps completed."""
    params: list[torch.Tensor] = dataclasses.field(default_factory=list)
    """The parameters as the optimizer holds them (followed when a group is added)."""
    param_names: list[str] = dataclasses.field(default_factory=list)
    param_order: list[int] = dataclasses.field(default_factory=list)
    """Where each parameter sits in the model's module order (backward reaches the last
    module first, whatever the optimizer's groups say)."""
    step_rng: dict[str, Any] = dataclasses.field(default_factory=dict)
    """RNG states at the start of the coming step (a replay of it draws from them)."""
    loss: torch.Tensor | None = None
    """The loss handed to `watch` for the coming step (on its device)."""
    watch_calls: int = 0
    """`watch(loss=...)` calls since the last optimizer step (a GradScaler skipping them all)."""
    clip_norm: torch.Tensor | None = None
    """The script's clip norm for the coming step (`Guard.note_clip_norm`): read with the
    step's own values (`StepStats.clip_norm`)."""
    current: Pending | LaneStep | None = None
    """The step between its pre- and post-update hooks."""
    pending: list[Pending] = dataclasses.field(default_factory=list)
    """Steps measured and not read yet (`read_every`, or a GPU's one-step-late read)."""
    stashed_grads: list[torch.Tensor | None] | None = None
    """The gradients a `skip` took away for the update; given back after it."""
    check_loaded: bool = True
    """Loaded state to check before the coming update (the first, and after a load)."""
    load_site: str | None = None
    """The line of the last `load_state_dict` seen."""
    last_stats: StepStats | None = None
    grad_baseline: GradBaseline = dataclasses.field(default_factory=GradBaseline)
    """Each parameter's typical grad norm on healthy steps (what a spike is measured against)."""
    losses: LossWatch = dataclasses.field(default_factory=LossWatch)
    """The loss level before any trouble, and since (`recovered` means back to it)."""
    loss_after: LossAfter | None = None
    """After a resume or an LR jump: the loss before it, for the first steps after."""
    skips_in_row: int = 0
    """Consecutive updates discarded (by `skip`, or by a fused optimizer's `found_inf`)."""
    agreed: bool = False
    """The step hook running took part in its cross-rank agreement already."""
    rerun_rank: int | None = None
    """The rank whose batch the last agreement asked to re-run on a peer (`pinpoint.xrank`)."""
