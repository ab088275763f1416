"""A seeded bit-flip fault injector for tests of numerical health checks.

`FaultInjector` plans flips (a parameter, a gradient, an activation or an optimizer-state
tensor; a bit index; a step; optionally a rank) and carries them out from hooks it installs on
the optimizer, the parameters and the modules, and removes again. Steps are counted like the
Guard counts them: step k is the one whose `optimizer.step()` is the (k+1)-th call.

When each kind lands, relative to step k:

- ``param`` and ``optimizer_state``: right after step k's update (an optimizer post-hook), so
  the forward of step k+1 is the first to see it.
- ``grad``: during step k's backward, as soon as the gradient is accumulated
  (`register_post_accumulate_grad_hook`): the Guard's pre-step read and step k's update see it.
  Under DDP the flip lands on this rank's local gradient, which DDP's all-reduce then
  averages in (or overwrites, depending on when its bucket is reduced).
- ``activation``: in the first forward call of the module during step k (a forward hook that
  returns a copy of the output with the bit flipped; autograd passes through it unchanged).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nanguard.runtime.distributed import rank as _rank
from nanguard.testing.bits import describe, flip_bit, unravel

TARGETS = ("param", "grad", "activation", "optimizer_state")


@dataclass(kw_only=True)
class Flip:
    """One planned bit flip; `old`, `new` and `index` are filled in when it fires."""

    target: str
    """``param``, ``grad``, ``activation`` or ``optimizer_state``."""
    name: str
    """The parameter's name (`model.named_parameters()`), or the module's for an activation."""
    step: int
    bit: int
    rank: int | None = None
    """Only on this rank under torch.distributed (None: every rank)."""
    key: str | None = None
    """The optimizer-state entry (``exp_avg``, ``momentum_buffer``...) for ``optimizer_state``."""
    index: tuple[int, ...] | None = None
    """The element; None: drawn when it fires, from the injector's seed (deterministic)."""
    persistent: bool = False
    """``grad`` and ``activation`` only: fire at every backward / forward from `step` on (on
    its rank), re-runs included, as a faulty device would; `old` and `new` are the last
    firing's, `times` counts them. False: once, so a re-run of the step no longer sees it."""
    fired: bool = False
    times: int = 0
    old: float | None = None
    new: float | None = None

    def __str__(self) -> str:
        what = f"{self.name}.{self.key}" if self.key else self.name
        done = describe(self.old, self.new) if self.fired else "not fired"  # type: ignore[arg-type]
        return (
            f"step {self.step} {self.target} {what}{list(self.index or [])} bit {self.bit}: {done}"
        )


class FaultInjector:
    """Flip chosen bits of a training run at chosen steps, deterministically.

    Use as a context manager (hooks installed on entry, removed on exit) or call `install()`
    and `remove()`. Plan flips with the `flip_*` methods before or during training; each
    returns its `Flip`, filled in when it fires (also listed in `fired`).

    Args:
        model: The module whose parameters, gradients and activations may be flipped.
        optimizer: The optimizer whose steps are counted (and whose state may be flipped).
        seed: Seeds the choice of element when a flip names none: the same seed, target,
            name and step always pick the same element, whatever the bit (so a harmless and a
            harmful flip can be compared on one element).
        step: The index of the next optimizer step: 0 for an injector made before training,
            `guard.step` for one made mid-run (its steps then match the Guard's).
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, seed: int = 0, step: int = 0
    ):
        self.model, self.optimizer, self.seed = model, optimizer, seed
        self.step = step
        self.planned: list[Flip] = []
        self._params = dict(model.named_parameters())
        self._modules = dict(model.named_modules())
        self._handles: list[Any] = []

    # ---------------------------------------------------------------- planning

    def flip_param(
        self,
        name: str,
        *,
        step: int,
        bit: int,
        index: tuple[int, ...] | None = None,
        rank: int | None = None,
    ) -> Flip:
        """Flip a parameter element right after step `step`'s update."""
        return self._plan("param", name, step, bit, index, rank)

    def flip_grad(
        self,
        name: str,
        *,
        step: int,
        bit: int,
        index: tuple[int, ...] | None = None,
        rank: int | None = None,
        persistent: bool = False,
    ) -> Flip:
        """Flip a gradient element during step `step`'s backward (before its update); with
        `persistent`, in every backward from then on (`Flip.persistent`)."""
        return self._plan("grad", name, step, bit, index, rank, persistent=persistent)

    def flip_activation(
        self,
        module: str,
        *,
        step: int,
        bit: int,
        index: tuple[int, ...] | None = None,
        rank: int | None = None,
        persistent: bool = False,
    ) -> Flip:
        """Flip an element of `module`'s output in its first forward call of step `step`; with
        `persistent`, in every forward call from then on (`Flip.persistent`)."""
        if module not in self._modules:
            raise ValueError(f"flip_activation: no module {module!r} (see model.named_modules())")
        return self._plan("activation", module, step, bit, index, rank, persistent=persistent)

    def flip_optimizer_state(
        self,
        name: str,
        key: str = "exp_avg",
        *,
        step: int,
        bit: int,
        index: tuple[int, ...] | None = None,
        rank: int | None = None,
    ) -> Flip:
        """Flip an element of `optimizer.state[param][key]` right after step `step`'s update."""
        return self._plan("optimizer_state", name, step, bit, index, rank, key=key)

    def _plan(
        self,
        target: str,
        name: str,
        step: int,
        bit: int,
        index: tuple[int, ...] | None,
        rank: int | None,
        key: str | None = None,
        persistent: bool = False,
    ) -> Flip:
        if target != "activation" and name not in self._params:
            raise ValueError(f"{target}: no parameter {name!r} (see model.named_parameters())")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        flip = Flip(target=target, name=name, step=step, bit=bit, rank=rank, key=key, index=index,
                    persistent=persistent)
        self.planned.append(flip)
        if self._handles and target in ("grad", "activation"):
            self._hook(flip)  # planned after install(): its own hook now
        return flip

    @property
    def fired(self) -> list[Flip]:
        """The flips carried out so far, in order."""
        return [f for f in self.planned if f.fired]

    # ---------------------------------------------------------------- hooks

    def install(self) -> FaultInjector:
        """Install the hooks (idempotent). Returns self."""
        if self._handles:
            return self
        opt = self.optimizer
        self._handles.append(opt.register_step_post_hook(self._after_step))
        for flip in self.planned:
            if flip.target in ("grad", "activation"):
                self._hook(flip)
        return self

    def remove(self) -> None:
        """Remove every hook; planned flips that have not fired never will."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> FaultInjector:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _hook(self, flip: Flip) -> None:
        if flip.target == "grad":
            param = self._params[flip.name]

            def on_grad(p: torch.Tensor) -> None:
                if self._due(flip) and p.grad is not None:
                    self._fire(flip, p.grad)

            self._handles.append(param.register_post_accumulate_grad_hook(on_grad))
            return

        def on_forward(_m: nn.Module, _inputs: Any, output: Any) -> Any:
            if not self._due(flip):
                return None
            return _replace_first(output, lambda t: self._fire_on_copy(flip, t), flip.name)

        self._handles.append(self._modules[flip.name].register_forward_hook(on_forward))

    def _fire_on_copy(self, flip: Flip, tensor: torch.Tensor) -> torch.Tensor:
        # A copy: the original may be saved for backward, where an in-place change would be
        # refused. Gradients pass through the copy unchanged, as through a real fault.
        copy = tensor.clone()
        self._fire(flip, copy)
        return copy

    def _due(self, flip: Flip) -> bool:
        if flip.rank not in (None, _rank()):
            return False
        if flip.persistent:
            return self.step >= flip.step
        return not flip.fired and flip.step == self.step

    def _after_step(self, *_: Any) -> None:
        for flip in self.planned:
            if flip.target in ("param", "optimizer_state") and self._due(flip):
                param = self._params[flip.name]
                if flip.target == "param":
                    self._fire(flip, param)
                else:
                    state = self.optimizer.state.get(param, {})
                    if flip.key not in state:
                        have = sorted(state) or "nothing yet"
                        raise ValueError(
                            f"optimizer_state: {flip.name} has no {flip.key!r} "
                            f"state (it has {have})"
                        )
                    self._fire(flip, state[flip.key])
        self.step += 1

    def _fire(self, flip: Flip, tensor: torch.Tensor) -> None:
        if flip.index is None:
            rng = random.Random(f"{self.seed}:{flip.target}:{flip.name}:{flip.key}:{flip.step}")
            flip.index = unravel(rng.randrange(max(tensor.numel(), 1)), tensor.shape)
        flip.old, flip.new = flip_bit(tensor, flip.index, flip.bit)
        flip.fired = True
        flip.times += 1


def _replace_first(output: Any, change: Any, module: str) -> Any:
    """`output` with its first tensor (the tensor itself, or item 0 of a tuple, named tuple or
    list: an LSTM's output before its states) replaced by `change(tensor)`.

    Raises:
        ValueError: an output with no tensor first (a dict, a dataclass, None).
    """
    if isinstance(output, torch.Tensor):
        return change(output)
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        first = change(output[0])
        if hasattr(output, "_fields"):  # a named tuple
            return output._replace(**{output._fields[0]: first})  # type: ignore[union-attr]
        return type(output)([first, *output[1:]])
    raise ValueError(
        f"flip_activation: module {module!r} returned {type(output).__name__}; flip the "
        "activation of a submodule that returns a tensor"
    )
