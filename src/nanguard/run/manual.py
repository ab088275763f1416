"""Step boundaries of training that updates its parameters by hand (no `optimizer.step()`).

Scripts written as `loss.backward(); p.data.add_(p.grad, alpha=-lr)` (a char-RNN language model
with manual SGD, a two-tensor regression on raw `requires_grad` tensors) never call an
optimizer, so no optimizer hook ever runs. `ManualBoundaries` makes the step boundaries out of
`backward()` instead, and runs them through `ManualStep`, a no-op `torch.optim.Optimizer` over
the trained tensors, so that everything built on optimizer step hooks (the `Guard`, the
`pinpoint.armed` step counter) sees ordinary optimizer steps:

* right after a `backward()` returns, the step's *pre* hooks run (global ones, then the
  optimizer's own): gradients and the loss are fresh, the update has not happened yet;
* the step's *post* hooks run at the next boundary: the start of the next `backward()`, the
  next module forward, or the end of the script (`finish()`): by then the hand-written update
  has been applied, so parameters are measured after it.

Boundaries are only made while no real optimizer exists: an optimizer constructed (any
`torch.optim.Optimizer` subclass other than `ManualStep`) or stepped switches them off for good,
so nothing is ever watched twice. The hooks are removed by `remove()`.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim import optimizer as _optim
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

_forked = False


def _in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_in_child)


def forked() -> bool:
    """This process is a fork of the one that installed the hooks (a DataLoader worker, a
    Hogwild trainer): hooks inherited through the fork must do nothing here."""
    return _forked


def own_hooks() -> None:
    """Hooks installed in this process from now on are its own (a resume point's child, which
    removed the run's inherited hooks): `forked()` is false again."""
    global _forked
    _forked = False


class _Replay:
    """Whether nanguard's in-process replay (pinpoint/recorded.py) is running: its forward,
    and the loss it returned (whose `backward()` is nanguard's, not the script's)."""

    def __init__(self) -> None:
        self.forward = False
        self.loss: weakref.ref[torch.Tensor] | None = None


REPLAY = _Replay()


def replaying(tensor: torch.Tensor | None = None) -> bool:
    """A replay's forward is running, or `tensor` is the loss a replay returned: the hooks
    that make step boundaries out of the script's forwards and backwards ignore it."""
    if REPLAY.forward:
        return True
    return tensor is not None and REPLAY.loss is not None and REPLAY.loss() is tensor


class ManualStep(torch.optim.Optimizer):
    """A no-op optimizer over tensors that the script updates itself.

    `step()` changes nothing. `begin()` runs the step pre-hooks (after `backward()`, before the
    script's own update) and `end()` the post-hooks (after it), exactly as `step()` would run
    them, global hooks included.

    Args:
        params: the trained leaf tensors (parameters or raw `requires_grad` tensors).
        names: optional display names by tensor id (raw tensors have no module to name them).
    """

    hand_written = True
    """The update is the script's own (the op checker reads this: pinpoint/checker.py)."""

    def __init__(self, params: Iterable[torch.Tensor],
                 names: dict[int, str] | None = None) -> None:
        super().__init__(list(params), {})
        self.names: dict[int, str] = dict(names or {})

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Nothing: the script applies its update itself."""
        return closure() if closure is not None else None

    def begin(self) -> None:
        """Run the step pre-hooks: global ones first, then this optimizer's own (a hook may
        register new ones on the way, e.g. a Guard attached by a global hook)."""
        args: tuple[Any, ...] = (self,)
        kwargs: dict[str, Any] = {}
        for hook in chain(list(_optim._global_optimizer_pre_hooks.values()),
                          _Lazy(lambda: list(self._optimizer_step_pre_hooks.values()))):
            result = hook(self, args, kwargs)
            if isinstance(result, tuple) and len(result) == 2:
                args, kwargs = result

    def end(self) -> None:
        """Run the step post-hooks: this optimizer's own first, then the global ones."""
        for hook in chain(list(self._optimizer_step_post_hooks.values()),
                          list(_optim._global_optimizer_post_hooks.values())):
            hook(self, (self,), {})


class _Lazy:
    """An iterable whose items are only computed when iteration reaches it."""

    def __init__(self, make: Callable[[], list[Any]]) -> None:
        self._make = make

    def __iter__(self) -> Any:
        return iter(self._make())


def leaves_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The leaf tensors that `tensor`'s autograd graph accumulates gradients into, in graph
    order (one walk of the graph; runs once, before the first boundary)."""
    fn = tensor.grad_fn
    if fn is None:
        return [tensor] if tensor.requires_grad else []
    out: list[torch.Tensor] = []
    seen_nodes: set[int] = set()
    seen: set[int] = set()
    todo = [fn]
    while todo:
        node = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        var = getattr(node, "variable", None)
        if isinstance(var, torch.Tensor) and id(var) not in seen:
            seen.add(id(var))
            out.append(var)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return out


def _script_names(tensors: list[torch.Tensor]) -> dict[int, str]:
    """Names of raw tensors as the script calls them (the innermost user frame's locals, then
    its globals), so a report can say `W` rather than `param0`."""
    from nanguard.pinpoint.attribution import is_internal

    wanted = {id(t) for t in tensors}
    names: dict[int, str] = {}
    f = sys._getframe(1)
    while f is not None:
        if not is_internal(f.f_code.co_filename):
            for scope in (f.f_locals, f.f_globals):
                for k, v in scope.items():
                    if isinstance(v, torch.Tensor) and id(v) in wanted:
                        names.setdefault(id(v), k)
            break
        f = f.f_back  # type: ignore[assignment]
    return names


class ManualBoundaries:
    """Make optimizer steps out of `backward()` while a script has no optimizer.

    Its own work (finding the trained tensors, naming them, making the `ManualStep`) fails
    open: an error of nanguard's there switches the boundaries off for good and goes to
    `on_error`; the script's `backward()` runs on untouched. Errors of the step hooks it runs
    are theirs to handle (a guard stands down by itself; `raise`'s error passes on).

    Args:
        roots: gives the root modules seen so far (their trainable parameters are watched along
            with the leaves the first loss reaches).
        on_create: called with the `ManualStep` when it is made (before its first `begin()`).
        on_error: called with an error of nanguard's own in the boundaries (None: printed).
    """

    def __init__(self, roots: Callable[[], list[nn.Module]] | None = None,
                 on_create: Callable[[ManualStep], None] | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.roots = roots or (lambda: [])
        self.on_create = on_create
        self.on_error = on_error
        self.optimizer: ManualStep | None = None
        self.enabled = True
        self.steps = 0
        self._leaves: list[torch.Tensor] | None = None
        self._pending = False
        self._handles: list[RemovableHandle] = []
        self._backward: Any = None
        self._init: Any = None
        self.last_loss: torch.Tensor | None = None
        """The last scalar backpropagated (detached, on its device: never read here)."""
        self.loss_seq = 0
        self.on_loss: Callable[[torch.Tensor], None] | None = None
        """Called with each scalar backpropagated, before its backward runs (its graph
        intact)."""
        self.created: list[weakref.ref[torch.optim.Optimizer]] = []
        """Real optimizers constructed while installed (one may never step)."""

    # ------------------------------------------------------------------ install / remove

    def install(self) -> ManualBoundaries:
        """Patch `Tensor.backward` and `Optimizer.__init__`; add a global forward pre-hook and
        a global optimizer step pre-hook (a real optimizer stepping switches this off)."""
        self._handles = [register_module_forward_pre_hook(self._forward_pre),
                         register_optimizer_step_pre_hook(self._real_step)]
        me = weakref.ref(self)
        original_backward = torch.Tensor.backward
        self._backward = original_backward

        def backward(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            m = me()
            if m is None or _forked or replaying(tensor):  # nanguard's replay: no boundary
                return original_backward(tensor, *args, **kwargs)
            if m.enabled:  # ends the previous step: before this loss is taken
                m._before_backward(tensor)
            if tensor.numel() == 1 and tensor.is_floating_point():
                m.last_loss, m.loss_seq = tensor.detach(), m.loss_seq + 1
                if m.on_loss is not None:
                    m.on_loss(tensor)
            if not m.enabled:
                return original_backward(tensor, *args, **kwargs)
            out = original_backward(tensor, *args, **kwargs)
            if m.enabled:
                m._after_backward()
            return out

        backward.__doc__ = original_backward.__doc__
        torch.Tensor.backward = backward  # type: ignore[method-assign,assignment]

        original_init = torch.optim.Optimizer.__init__
        self._init = original_init

        def init(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original_init(opt, *args, **kwargs)
            m = me()
            if m is not None and not _forked and not isinstance(opt, ManualStep):
                m.created.append(weakref.ref(opt))
                m._real_optimizer()

        torch.optim.Optimizer.__init__ = init  # type: ignore[method-assign,assignment]
        return self

    def remove(self) -> None:
        """Remove every hook and patch (idempotent). A pending step is not ended here: call
        `finish()` first when the script ended normally."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._backward is not None:
            torch.Tensor.backward = self._backward  # type: ignore[method-assign]
            self._backward = None
        if self._init is not None:
            torch.optim.Optimizer.__init__ = self._init  # type: ignore[method-assign]
            self._init = None

    def finish(self) -> None:
        """End the pending step, if any (at the end of the script)."""
        self._end()

    def stand_aside(self) -> None:
        """No more boundaries, and the pending step dropped, not ended. Called by
        `Discovery.stand_aside` in a fork that goes on with the script (the parent ends
        that step)."""
        self.enabled = self._pending = False

    # ------------------------------------------------------------------ boundaries

    def _real_optimizer(self) -> None:
        """A real optimizer exists: it makes the boundaries from now on."""
        if self.enabled:
            self._end()
            self.enabled = False
            self._leaves = None
            if self._handles:  # the forward hook is of no use any more (never while
                self._handles[0].remove()  # torch iterates the forward hooks: not called there)

    def _real_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not _forked and not isinstance(optimizer, ManualStep):
            self._real_optimizer()

    def _forward_pre(self, module: nn.Module, args: Any) -> None:
        if self._pending and not _forked and not replaying():
            self._end()

    def _before_backward(self, tensor: torch.Tensor) -> None:
        self._end()
        if self.optimizer is None and self._leaves is None:
            try:
                self._leaves = [t for t in leaves_of(tensor) if t.requires_grad]
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                self._fail(exc)

    def _after_backward(self) -> None:
        if self.optimizer is None:
            try:
                self._create()
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                self._fail(exc)
        if self.optimizer is None or not self.enabled:
            return
        self._pending = True
        try:
            self.optimizer.begin()
        except BaseException:
            self._pending = False  # a raising pre-hook aborts the step, as in `step()`
            raise

    def _fail(self, exc: BaseException) -> None:
        """An error of nanguard's own here: no more boundaries, the script goes on."""
        self.enabled = False
        self.optimizer = None
        self._leaves = None
        if self.on_error is not None:
            self.on_error(exc)
        else:
            print(f"nanguard: internal error in the hand-written step boundaries "
                  f"({type(exc).__name__}: {exc}); they stand down, training goes on",
                  file=sys.stderr)

    def _end(self) -> None:
        if not self._pending or self.optimizer is None:
            return
        self._pending = False
        self.steps += 1
        self.optimizer.end()

    def _create(self) -> None:
        leaves = self._leaves or []
        params: list[torch.Tensor] = []
        seen: set[int] = set()
        for root in self.roots():
            for p in root.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        stray = [t for t in leaves if id(t) not in seen and t.is_leaf]
        params += stray
        if not params:
            return
        self.optimizer = ManualStep(params, names=_script_names(stray) if stray else None)
        self._leaves = None
        if self.on_create is not None:
            self.on_create(self.optimizer)
