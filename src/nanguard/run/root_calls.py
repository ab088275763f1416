"""What `nanguard run` learns from the forwards of a script's root modules (run/discovery.py
calls it from its global forward hooks): which modules are roots, each root's batch since
its optimizer's last step, and whether the last few training outputs held a NaN or an Inf.

A root module is one called while no other module's forward runs (a model, a loss module).
The batch of a root is the first tensor input of a grad-enabled call that no root produced
(a GAN's discriminator sees `real` and `G(z).detach()`: `real` is the data); one per
backward, so gradient accumulation's micro-batches are kept in order. Nothing here reads a
device value on the host: the output flags are two reductions on the device, read once at
the end of the run.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, ...] | dict[str, torch.Tensor]

_MAX_OUTPUTS = 32
"""Root outputs remembered (weakly) to tell a produced input from data."""


@dataclass
class _Inputs:
    data: list[Batch] = field(default_factory=list)
    """The batch of each backward() of the step (several: the micro-batches of gradient
    accumulation), in order: the inputs of the first grad-enabled call before it that no
    module produced."""
    taken: bool = False
    """This backward's batch is in `data` already."""
    other: tuple[torch.Tensor, ...] | None = None
    """The first call's inputs when a module produced them (a discriminator fed a generator)."""


class RootCalls:
    """The root modules a script calls, their batches and their last training outputs."""

    def __init__(self) -> None:
        self._roots: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._has_params: weakref.WeakKeyDictionary[nn.Module, bool] = \
            weakref.WeakKeyDictionary()
        self._inputs: dict[int, _Inputs] = {}
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._depth = 0
        self._train_outputs: list[tuple[str, torch.Tensor]] = []
        """(module class, [has NaN, has Inf]) of the last few grad-enabled root forwards'
        outputs (model output, loss module): two reductions on the device per root forward,
        read only at the end of the run (the outputs themselves are not kept)."""

    def roots(self) -> list[nn.Module]:
        """The root modules seen and still alive."""
        return list(self._roots.values())

    # ------------------------------------------------------------------ forward hooks

    def enter(self, module: nn.Module) -> bool:
        """A module's forward begins; True when it is a root's (no other forward runs)."""
        self._depth += 1
        if self._depth != 1:
            return False
        self._roots[id(module)] = module
        return True

    def leave(self) -> bool:
        """A module's forward returned (or raised); True when it was a root's."""
        self._depth = max(0, self._depth - 1)
        return not self._depth

    def holds_params(self, module: nn.Module) -> bool:
        """Whether a root holds parameters (a model, not a loss module); asked once per root."""
        params = self._has_params.get(module)
        if params is None:
            params = self._has_params[module] = next(module.parameters(), None) is not None
        return params

    def saw_inputs(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A grad-enabled root forward's positional inputs: its batch, unless a root made
        them."""
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0)
        if not tensors:
            return
        rec = self._inputs.setdefault(id(module), _Inputs())
        if not any(self._produced(t) for t in tensors):
            if not rec.taken:
                rec.data.append(tensors)
                rec.taken = True
        elif rec.other is None:
            rec.other = tensors

    def saw_keywords(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        """A model called by keywords only (`model(input_ids=ids, labels=y)`, the transformers
        style; the pre-hook sees no positional tensor): its keyword tensors are the batch, as
        a dict, when no module produced them. Only for a grad-enabled call of a root that
        holds parameters."""
        rec = self._inputs.setdefault(id(module), _Inputs())
        if rec.taken:
            return
        batch = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if batch and not any(self._produced(t) for t in batch.values()):
            rec.data.append(batch)
            rec.taken = True

    def saw_output(self, module: nn.Module, output: Any) -> None:
        """A root forward's output: flagged when it trains, remembered (weakly) so that an
        input it becomes is not taken for data."""
        if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
            output = output[0]  # an RNN's (output, hidden)
        if not isinstance(output, torch.Tensor):
            return
        if torch.is_grad_enabled() and output.is_floating_point() and output.numel():
            with torch.no_grad():
                flags = torch.stack([output.isnan().any(), output.isinf().any()])
            self._train_outputs = [*self._train_outputs[-3:], (type(module).__name__, flags)]
        self._outputs = [r for r in self._outputs if r() is not None][-_MAX_OUTPUTS:]
        self._outputs.append(weakref.ref(output))

    def _produced(self, t: torch.Tensor) -> bool:
        """`t` shares storage with a live output of a root module (e.g. `G(z).detach()`)."""
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return False
        for r in self._outputs:
            out = r()
            if out is not None and out.untyped_storage().data_ptr() == ptr:
                return True
        return False

    # ------------------------------------------------------------------ batches

    def next_micro_batch(self) -> None:
        """A backward ran: the next forward of each root is the next micro-batch's."""
        for rec in self._inputs.values():
            rec.taken = False

    def take_batches(self, roots: list[nn.Module]) -> list[Batch]:
        """The step's batches (its micro-batches, in order) of the first of `roots` called
        with any; they are let go here."""
        for root in roots:
            rec = self._inputs.pop(id(root), None)
            if rec is not None:
                return rec.data or ([rec.other] if rec.other is not None else [])
        return []

    def drop_batches(self) -> None:
        """Forget every batch seen (an iteration the GradScaler skipped)."""
        self._inputs.clear()

    def owners(self, optimizer: torch.optim.Optimizer) -> list[nn.Module]:
        """Root modules holding the optimizer's parameters, most parameters first; a root that
        is a submodule of another root (called on its own somewhere) is left out."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        roots = self.roots()
        inner: set[int] = set()
        for r in roots:
            inner |= {id(m) for m in r.modules() if m is not r}
        counts = []
        for r in roots:
            if id(r) in inner:
                continue
            n = sum(1 for p in r.parameters() if id(p) in held)
            if n:
                counts.append((n, r))
        counts.sort(key=lambda c: -c[0])
        return [r for _, r in counts]

    # ------------------------------------------------------------------ end of run

    def nonfinite_outputs(self, *, on_error: bool) -> list[str]:
        """Classes of the last training outputs that held a NaN (on the error path also an
        Inf), newest first: one host read each, at the end of the run only."""
        names = []
        for name, flags in reversed(self._train_outputs):
            nan, inf = (bool(v) for v in flags.tolist())
            if nan or (inf and on_error):
                names.append(name)
        return names

    def release(self) -> None:
        """Drop the output flags kept for the end-of-run check."""
        self._train_outputs.clear()

    def clear(self) -> None:
        """Forget the outputs and batches seen (the hooks are removed)."""
        self._outputs.clear()
        self._inputs.clear()
