"""Re-execute one training step under the op-level checker.

`StepSnapshot.capture` keeps what a step depends on (parameters, buffers, gradients, optimizer
state including step counters, RNG states); `replay_step` restores it and runs the user's step
closure under the checker; `find_origin` runs the closure under the checker without restoring
anything. The closure does forward, loss, backward and `optimizer.step()`, and may return the
loss (it then enters the fingerprint).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard.pinpoint.attribution import Attribution, replay_boundary
from nanguard.pinpoint.checker import NonfiniteChecker
from nanguard.pinpoint.origin import Origin
from nanguard.watch import rng

StepFn = Callable[[], Any]


@dataclass(kw_only=True)
class StepSnapshot:
    """The state one training step starts from, kept in memory (clones)."""

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor | None]
    optimizer: dict[str, Any] | None
    """`optimizer.state_dict()`, deep-copied (state tensors and step counters included)."""
    rng: dict[str, Any]
    model: nn.Module
    opt: torch.optim.Optimizer | None

    @classmethod
    def capture(cls, model: nn.Module,
                optimizer: torch.optim.Optimizer | None = None) -> StepSnapshot:
        """Copy the state of `model` and `optimizer` and the RNG states, now.

        Call it right before the step's batch is drawn or consumed (e.g. in an optimizer
        post-hook of the previous step) so a replay sees the same random numbers.
        """
        with torch.no_grad():
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            grads = {n: None if p.grad is None else p.grad.detach().clone()
                     for n, p in model.named_parameters()}
            buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        return cls(params=params, buffers=buffers, grads=grads, optimizer=state,
                   rng=rng.capture(), model=model, opt=optimizer)

    def restore(self) -> None:
        """Put parameters, buffers, gradients, optimizer state and RNG states back, in place
        (the same parameter objects, so the optimizer and any hooks keep working)."""
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(self.params[n])
                g = self.grads.get(n)
                p.grad = None if g is None else g.clone()
            for n, b in self.model.named_buffers():
                b.copy_(self.buffers[n])
        if self.opt is not None and self.optimizer is not None:
            self.opt.load_state_dict(copy.deepcopy(self.optimizer))
        rng.restore(self.rng)


def step_fingerprint(model: nn.Module, loss: Any = None) -> str:
    """A hash of every parameter's bytes (and the loss, when a tensor or float is given).

    Non-finite values hash by their bit pattern, so two runs that fail identically match.
    """
    h = hashlib.blake2b(digest_size=16)
    for n, p in model.named_parameters():
        h.update(n.encode())
        h.update(p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    if isinstance(loss, torch.Tensor):
        h.update(loss.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                 .numpy().tobytes())
    elif isinstance(loss, float):
        h.update(repr(loss).encode())
    return h.hexdigest()


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def run_checked(run_step: StepFn, *, model: nn.Module | None,
                optimizer: Optimizers = None, batch: Any = None,
                step: int | None = None, rank: int = 0) -> tuple[Origin | None, Any]:
    """Run `run_step()` under the checker; return (origin or None, what it returned)."""
    attr = Attribution(model=model, batch_size=_batch_size(batch)).install()
    checker = NonfiniteChecker(attr, step=step, rank=rank)
    try:
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else optimizer or []
        for opt in opts:
            attr.hook_optimizer(opt)
        if batch is not None:
            checker.seed_batch(batch)
        # The frames above this one ran the step before (the hook that triggered the
        # replay, the script's `optimizer.step()` line): no op of the replay ran there.
        with checker, replay_boundary():
            result = run_step()
    finally:
        attr.remove()
    return checker.origin, result


def find_origin(run_step: StepFn, *, model: nn.Module | None,
                optimizer: Optimizers = None, batch: Any = None,
                step: int | None = None) -> Origin | None:
    """Run one step under the checker (nothing restored first) and return the origin.

    Args:
        run_step: closure doing forward, loss, backward and `optimizer.step()`.
        model: the model, for module names (None: discovered as modules run).
        optimizer: hooked to mark the optimizer phase (or several, e.g. a GAN's two); without
            it the optimizer's ops count as backward.
        batch: the step's batch (tensor / tuple / list / dict); a non-finite element is
            reported as the `data` phase with its rows, and sets the batch size for `samples`.
        step: written into the origin.

    Returns:
        The origin, or None when the step produced no non-finite value.
    """
    return run_checked(run_step, model=model, optimizer=optimizer, batch=batch, step=step)[0]


def replay_step(run_step: StepFn, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                snapshot: StepSnapshot, batch: Any = None, fingerprint: str | None = None,
                step: int | None = None) -> Origin | None:
    """Restore `snapshot`, re-run the step under the checker, say whether it reproduced.

    Args:
        run_step: the step closure (see `find_origin`); it may return the loss.
        model, optimizer: the ones `snapshot` was captured from.
        snapshot: the state before the original step.
        batch: the step's batch, as for `find_origin`.
        fingerprint: `step_fingerprint(model, loss)` taken right after the original step;
            the replay's is compared with it. None skips the comparison.
        step: written into the origin.

    Returns:
        The origin with `reproduced` set (None without a fingerprint). When the replay produced
        nothing non-finite: None if it matched the fingerprint (or none was given), else an
        `Origin(phase=None, kind="none", reproduced=False)`: the original failure did not
        recur, which suggests non-determinism (a race, hardware).
        The model and optimizer are left as the replayed step left them.
    """
    snapshot.restore()
    origin, result = run_checked(run_step, model=model, optimizer=optimizer, batch=batch,
                                 step=step)
    reproduced = None
    if fingerprint is not None:
        reproduced = step_fingerprint(model, result) == fingerprint
    if origin is None:
        if reproduced is False:
            return Origin(step=step, phase=None, kind="none", reproduced=False)
        return None
    origin.reproduced = reproduced
    return origin


def _batch_size(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (list, tuple)):
        return next((s for s in map(_batch_size, batch) if s is not None), None)
    if isinstance(batch, dict):
        return next((s for s in map(_batch_size, batch.values()) if s is not None), None)
    return None
