"""What `nanguard run` keeps for each optimizer it finds, and what that optimizer's guard is given.

`Discovery` (run/discovery.py) builds a `Watched` the first time an optimizer steps
(or, at the end of a run, for one that never did) and attaches a guard to it with two things
from here: the model (`as_model`: the one root module holding its parameters, a `ModuleDict`
over several, or a holder of bare trained tensors when no module was seen) and, through
`replay_recorded`, the guard's `replay` function: the step's recorded model call and loss
(pinpoint/recorded.py), run again by the guard before the update at the first step whose
signals went non-finite, or on one sample of the batch to find the samples of a spike. The
runner's epilogue (run/run_reports.py, run/rerun.py) reads the `Watched` list
after the script: each part's guard, folder, step starts and in-process replay outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from nanguard.guard import Guard
from nanguard.pinpoint import loss_expr
from nanguard.pinpoint.inprocess import compare_as
from nanguard.pinpoint.recorded import (
    ClosureRecipe,
    MicroRecipes,
    NotReplayable,
    Recipe,
    mark_replayed_loss,
    replay_forward,
)
from nanguard.run.manual import ManualStep

__all__ = ["Watched", "as_model", "holds_compiled", "replay_recorded"]


@dataclass
class Watched:
    """One optimizer found while the script ran, and the guard attached to it."""

    index: int
    optimizer: torch.optim.Optimizer
    guard: Guard | None
    model: nn.Module | None
    folder: Path
    roots: list[nn.Module] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    """Global index (over all optimizers' steps) at which each of this optimizer's steps began:
    what `pinpoint.armed` counts."""
    loss_seq: int = 0
    updates_seen: int = 0
    """Its steps begun when a GradScaler last updated (a skipped step begins none)."""
    error: str | None = None
    note: str | None = None
    """A one-line remark printed with the summary (e.g. a policy that could not apply)."""
    recipe: Recipe | ClosureRecipe | MicroRecipes | str | None = None
    """How to replay the step in progress in process (pinpoint/recorded.py), or why it cannot
    be; set at the step's start, dropped after its update."""
    in_process: dict[str, Any] | None = None
    """The guard's in-process replay of the first non-finite step: `before` (the finding as
    the watched signals gave it), `reason` when it could not run."""

    @property
    def manual(self) -> bool:
        """Hand-written updates, watched through a `ManualStep`."""
        return isinstance(self.optimizer, ManualStep)

    @property
    def name(self) -> str:
        return f"optimizer-{self.index}"

    def global_step(self, step: int) -> int | None:
        return self.starts[step] if 0 <= step < len(self.starts) else None


def holds_compiled(module: nn.Module) -> bool:
    """A `torch.compile`d module, or one holding one."""
    return any(type(m).__name__ == "OptimizedModule" for m in module.modules())


class _Leaves(nn.Module):
    """Holds raw trained tensors (`W = torch.zeros(..., requires_grad=True)`) that belong to no
    module, so a guard can name them: `named_parameters()` yields them under the script's
    names (they are not `nn.Parameter`s and are not registered as such)."""

    def __init__(self, tensors: list[torch.Tensor], names: dict[int, str]) -> None:
        super().__init__()
        self._leaves = [(names.get(id(t), f"param{i}"), t) for i, t in enumerate(tensors)]

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        seen: set[int] = set()
        for name, t in self._leaves:
            if id(t) not in seen:
                seen.add(id(t))
                yield name, t

    def parameters(self, *args: Any, **kwargs: Any) -> Any:
        for _, t in self.named_parameters():
            yield t


def as_model(roots: list[nn.Module], optimizer: torch.optim.Optimizer) -> nn.Module:
    """The module handed to the guard: the one root, a `ModuleDict` over several, or a holder
    of the bare parameters when no module was seen."""
    if len(roots) == 1:
        return roots[0]
    if roots:
        names: dict[str, nn.Module] = {}
        for r in roots:
            base = type(r).__name__.lower()
            name, i = base, 1
            while name in names:
                name, i = f"{base}{i}", i + 1
            names[name] = r
        return nn.ModuleDict(names)
    leaf_names = optimizer.names if isinstance(optimizer, ManualStep) else {}
    return _Leaves([p for g in optimizer.param_groups for p in g["params"]], leaf_names)


def replay_recorded(w: Watched, batch: Any) -> torch.Tensor:
    """The `replay` function of `w`'s guard: the recorded step's forward and loss.

    Called by the guard, before the update, at the first step whose signals went
    non-finite, and with one sample of the batch to find the samples of a spike (a
    per-sample loss: the recorded call and loss on that sample's rows).

    Raises:
        NotReplayable: the step is not one the recorder can replay, or the finding is one
            the runner pinpoints otherwise (the batch held it, or a checkpoint did).
    """
    guard = w.guard
    first = guard.first_nonfinite if guard is not None else None
    if first is not None and w.in_process is None:
        w.in_process = {"before": dict(first)}
    recipe = w.recipe
    if isinstance(recipe, MicroRecipes):
        recipe = recipe.part(batch) or recipe.parts[0]  # (no part: refused just below)
    if first is not None and first.get("phase") in ("data", "checkpoint"):
        reason = f"phase {first['phase']}: the re-run looks for it before the step"
    elif not isinstance(recipe, (Recipe, ClosureRecipe)):
        reason = recipe or "no step recorded"
    elif not recipe.matches(batch) and _sample_of(recipe, batch) is None:
        reason = ("not the batch of the recorded step, nor one of its samples (a closure "
                  "replays whole steps only)")
    else:
        try:
            with replay_forward(), torch.enable_grad():
                if recipe.matches(batch):
                    loss = recipe.run()
                    unscaled = (loss_expr.unscale(recipe.expr, loss.detach())
                                if isinstance(recipe, Recipe) and recipe.expr is not None
                                else None)
                    if unscaled is not None:  # the guard recorded it unscaled
                        compare_as(loss, unscaled)
                else:  # one sample of the batch: a spike's per-sample gradients
                    at = _sample_of(recipe, batch)
                    assert at is not None  # (tested above)
                    loss = cast(Recipe, recipe).run(*at)
        except NotReplayable as exc:
            reason = str(exc)
        else:
            mark_replayed_loss(loss)
            return loss
    if first is not None and w.in_process is not None:
        w.in_process.setdefault("reason", reason)
    raise NotReplayable(reason)


def _sample_of(recipe: Recipe | ClosureRecipe, batch: Any) -> tuple[int, int] | None:
    """Which sample of `recipe`'s batch `batch` is, and on which axis (None: none, or a
    closure's step)."""
    return recipe.sample_of(batch) if isinstance(recipe, Recipe) else None
