"""Find the optimizers, models, losses and batches of a script that knows nothing of nanguard.

`Discovery` installs PyTorch's global hooks while an unmodified script runs (`nanguard run`):

* a global optimizer step pre-hook: the first time an optimizer steps, a `Guard` is attached to
  it (its own hooks then run in that same step: global pre-hooks run before per-optimizer ones);
* global module forward pre/post hooks: the root modules (called while no other module's forward
  runs) and the first tensor arguments of each root's forward, i.e. the batch;
* a wrapper around `torch.Tensor.backward`: the scalar being backpropagated is the loss.

The model given to a guard is the root module that holds the optimizer's parameters (several
roots: a `ModuleDict` over them, names prefixed by the root's class). The batch given to a guard
is the first input of its model's forward since that optimizer's previous step that was not
produced by another module's forward (a GAN's discriminator sees `real` and `G(z).detach()`:
`real` is the data). Every hook and patch is removed by `remove()`; nothing here reads a device
value on the host.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from nanguard.config import GuardConfig, RecordConfig
from nanguard.guard import Guard

_MAX_OUTPUTS = 32


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
    error: str | None = None

    @property
    def name(self) -> str:
        return f"optimizer-{self.index}"

    def global_step(self, step: int) -> int | None:
        return self.starts[step] if 0 <= step < len(self.starts) else None


@dataclass
class _Inputs:
    data: tuple[torch.Tensor, ...] | None = None
    other: tuple[torch.Tensor, ...] | None = None


class Discovery:
    """Attach guards to whatever optimizers a script steps; see the module docstring.

    Args:
        folder_for: gives the run folder of the n-th optimizer found (called when it is found).
        policy: the guards' policy.
        config: base guard config (its `record.out` and `policy` are overridden).
    """

    def __init__(
        self,
        folder_for: Callable[[int], Path],
        *,
        policy: str = "observe",
        config: GuardConfig | None = None,
    ) -> None:
        self.folder_for = folder_for
        self.policy = policy
        self.config = config or GuardConfig(record=RecordConfig(summary=False))
        self.watched: list[Watched] = []
        self._by_opt: dict[int, Watched] = {}
        self._roots: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._inputs: dict[int, _Inputs] = {}
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._depth = 0
        self._loss: torch.Tensor | None = None
        self._loss_seq = 0
        self._steps = 0
        self._handles: list[RemovableHandle] = []
        self._backward: Any = None

    # ------------------------------------------------------------------ install / remove

    def install(self) -> Discovery:
        self._handles = [
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_module_forward_pre_hook(self._forward_pre),
            register_module_forward_hook(self._forward_post, always_call=True),
        ]
        original = torch.Tensor.backward
        self._backward = original
        me = weakref.ref(self)

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            d = me()
            if d is not None:
                d._saw_backward(tensor)
            return original(tensor, *args, **kwargs)

        backward.__doc__ = original.__doc__
        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]
        return self

    def remove(self) -> None:
        """Remove every global hook and the `backward` patch (idempotent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._backward is not None:
            torch.Tensor.backward = self._backward  # type: ignore[method-assign]
            self._backward = None
        self._outputs.clear()
        self._inputs.clear()
        self._loss = None

    # ------------------------------------------------------------------ hooks

    def _saw_backward(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 1 and tensor.is_floating_point():
            self._loss = tensor.detach()
            self._loss_seq += 1

    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._depth += 1
        if self._depth != 1:
            return
        self._roots[id(module)] = module
        if not torch.is_grad_enabled():
            return  # evaluation (`no_grad`): not a training batch
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0)
        if not tensors:
            return
        rec = self._inputs.setdefault(id(module), _Inputs())
        if rec.data is None and not any(self._produced(t) for t in tensors):
            rec.data = tensors
        elif rec.other is None:
            rec.other = tensors

    def _forward_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth or not isinstance(output, torch.Tensor):
            return
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

    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        w = self._by_opt.get(id(optimizer))
        if w is None or w.optimizer is not optimizer:
            w = self._attach(optimizer)
        w.starts.append(self._steps)
        self._steps += 1
        if w.guard is None or w.guard._closed:
            return
        loss = self._loss if self._loss_seq > w.loss_seq else None
        w.loss_seq = self._loss_seq
        batch = self._take_batch(w)
        w.guard.watch(loss=loss, batch=batch)

    # ------------------------------------------------------------------ guards

    def _attach(self, optimizer: torch.optim.Optimizer) -> Watched:
        index = len(self.watched)
        folder = self.folder_for(index)
        roots = self._owners(optimizer)
        model = _as_model(roots, optimizer)
        w = Watched(index=index, optimizer=optimizer, guard=None, model=model, folder=folder,
                    roots=roots)
        try:
            w.guard = Guard(model, optimizer, policy=self.policy, out=str(folder),
                            config=self.config)
            # How to run it again (`nanguard replay`): sys.argv is the script's here.
            w.guard.store.write_meta(script=os.path.abspath(sys.argv[0]), argv=sys.argv[1:],
                                     cwd=os.getcwd(), optimizers=index + 1)
        except Exception as exc:  # noqa: BLE001 - the script must run on regardless
            w.error = f"{type(exc).__name__}: {exc}"
        self.watched.append(w)
        self._by_opt[id(optimizer)] = w
        return w

    def _owners(self, optimizer: torch.optim.Optimizer) -> list[nn.Module]:
        """Root modules holding the optimizer's parameters, most parameters first; a root that
        is a submodule of another root (called on its own somewhere) is left out."""
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        roots = list(self._roots.values())
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

    def _take_batch(self, w: Watched) -> tuple[torch.Tensor, ...] | None:
        for root in w.roots:
            rec = self._inputs.pop(id(root), None)
            if rec is not None:
                return rec.data if rec.data is not None else rec.other
        return None


def _as_model(roots: list[nn.Module], optimizer: torch.optim.Optimizer) -> nn.Module:
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
    holder = nn.Module()
    holder.params = nn.ParameterList(
        [p for g in optimizer.param_groups for p in g["params"] if isinstance(p, nn.Parameter)]
    )
    return holder
