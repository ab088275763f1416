"""The in-process replay of `nanguard run`: each step's forward and loss, kept by reference.

A script run by `nanguard run` never hands nanguard a `replay(batch) -> loss` function, and
re-running the whole script up to the failing step (run/rerun.py, the fallback) costs as long
as the run did. `StepRecorder` instead records, while the script runs, what re-executing a step's
forward and loss needs, and `Recipe.run()` is then the `replay` function the `Guard` calls at
the first non-finite step, before the update (pinpoint/inprocess.py; the recipes are in
pinpoint/recipe.py and pinpoint/closure_recipe.py). What is kept per step:

* the trained model's root call: the module, its positional and keyword arguments (the global
  forward pre-hook gives the positional ones, the global forward hook, `with_kwargs`, the
  keywords), the version counters of the tensors among them, the torch RNG states and the
  autocast state when it started;
* the loss: the `torch.nn.functional` loss call (loss modules call these too) caught by the
  wrappers of audit/preflight_live.py (`LOSS_FUNCTIONS`, `find_path`: the same mechanism), with its
  other arguments and how its input came from the output (the output itself, or a contiguous
  view / reshape of it); or the output element itself when the model returns its loss;
* which of them each `backward()` of the step took: the loss itself, an element of the output,
  or an expression over recorded losses (pinpoint/loss_expr.py: `loss / k` of gradient
  accumulation, a GradScaler's `scaler.scale(loss)`, a discriminator's
  `bce(D(real), 1) + bce(D(fake), 0)`), read from the autograd graph before the backward
  frees its constants.

Everything is held by reference (no copies, no device reads): the arguments until the step's
update (at most `MAX_CALLS` calls per backward), the outputs only weakly (a grad-enabled
forward the script throws away keeps no activations alive here), and the loss values weakly
too. A step is replayable only when it is that simple: per backward, the calls of the model
before it each reaching a recognised loss (one call, or several whose losses the expression
sums), no torch.distributed, no batch changed in place since. Several backwards (gradient
accumulation) make one recipe each (`MicroRecipes`): the runner hands the guard each
micro-batch, and the guard replays them in turn.
A step of `optimizer.step(closure)` (LBFGS, or any torch.optim optimizer given a closure) is
replayed by calling the closure again (`ClosureRecipe`): it runs forward, loss and backward
itself, so the checker labels its ops by what they are; the closure's variables are put back
afterwards. A step whose loss is the script's own arithmetic (`-(y * log(h) + ...).mean()`)
gets its forward replayed alone: an origin is taken only when the forward's output is
non-finite (the step's first non-finite value was then made in the forward). A closure's later
calls inside one LBFGS `step()` are not replayed here (the parameters have moved by then).
Anything else gets a one-line reason and the runner falls back to re-running the script.

While a replay runs, `replaying()` (run/manual.py) is true for its forward and for the
`backward()` of the loss it returned, so that the step-boundary hooks of the runner
(`Discovery`, `ManualBoundaries`) do not take nanguard's own forward and backward for the
script's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn

from nanguard.audit.preflight_live import LOSS_FUNCTIONS, find_path, select_path, wrap_call
from nanguard.pinpoint import loss_expr
from nanguard.pinpoint.attribution import user_source
from nanguard.pinpoint.closure_recipe import ClosureRecipe
from nanguard.pinpoint.recipe import (
    MAX_CALLS,
    LossCall,
    MicroRecipes,
    NotReplayable,
    Recipe,
    RootCall,
    amp_state,
    flat_versions,
    live_tree,
    weak_tree,
)
from nanguard.run.manual import REPLAY, forked, replaying
from nanguard.watch import rng

__all__ = ["ClosureRecipe", "MicroRecipes", "NotReplayable", "Recipe", "StepRecorder",
           "mark_replayed_loss", "replay_forward"]

def _scalars(output: Any, path: tuple[Any, ...] = (), depth: int = 0
             ) -> list[tuple[tuple[Any, ...], torch.Tensor]]:
    """The 0-dim floating tensors with a gradient in a module's output, with their paths (to
    the depth `find_path` looks): the candidates for a loss the model returns."""
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 and output.requires_grad and output.is_floating_point():
            return [(path, output)]
        return []
    if depth >= 2:
        return []
    items: Any = ()
    if isinstance(output, (tuple, list)):
        items = enumerate(output)
    elif isinstance(output, dict):
        items = output.items()
    return [found for k, v in items for found in _scalars(v, (*path, k), depth + 1)]


Target = Any
"""What a backward took: a recorded loss, an expression over recorded losses (`loss_expr`:
`Scaled`, `Combined`), (call, path) of an output element, or None."""


class _Window:
    """What the script did since the last `backward()` (a plain class: one is made per
    backward); the finished ones of the step are kept in `micro`."""

    __slots__ = ("calls", "dropped", "losses", "micro", "target")

    def __init__(self, micro: list[_Window] | None = None) -> None:
        self.calls: list[RootCall] = []
        self.losses: list[LossCall] = []
        self.target: Target = None
        self.dropped = False
        self.micro: list[_Window] = micro if micro is not None else []
        """The windows of the step's earlier backwards (gradient accumulation), in order."""


class StepRecorder:
    """Records root calls, loss calls and backwards between step boundaries (see the module
    docstring). The runner's hooks feed it; `boundary()` turns a window into a `Recipe`.

    Hooks run on the script's hot path: each does a few attribute reads and list appends, never
    a device read or a copy.
    """

    def __init__(self) -> None:
        self.paused = False
        """Set while the runner is quiet (the preflight trains its copies)."""
        self._window = _Window()
        self._patched: dict[str, Any] = {}

    # ------------------------------------------------------------------ install / remove

    def install(self) -> StepRecorder:
        """Wrap the `torch.nn.functional` losses (they pass straight through)."""
        import torch.nn.functional as F

        me = cast(Any, weakref.ref(self))  # `wrap_call` calls `.done` and `._saw_loss` on it
        for name in LOSS_FUNCTIONS:
            original = getattr(F, name, None)
            if original is None or name in self._patched:
                continue
            self._patched[name] = original
            setattr(F, name, wrap_call(name, original, me))
        return self

    def remove(self) -> None:
        """Put the loss functions back and drop every reference (idempotent). Call it after
        anything that wrapped them on top (the live preflight) has put them back."""
        import torch.nn.functional as F

        for name, original in self._patched.items():
            setattr(F, name, original)
        self._patched = {}
        self._window = _Window()

    def reset(self) -> None:
        """Forget what was recorded since the last step boundary."""
        self._window = _Window()

    @property
    def done(self) -> bool:
        """The loss wrappers' question (`preflight_live.wrap_call`): ignore this call?"""
        return self.paused or forked() or replaying()

    # ------------------------------------------------------------------ what the script does

    def saw_call(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A grad-enabled call of a root module with parameters starts (the global forward
        pre-hook): its positional arguments, RNG and autocast states."""
        w = self._window
        if len(w.calls) >= MAX_CALLS:
            w.dropped = True
            return
        w.calls.append(RootCall(module, args, {}, flat_versions(args, {}), rng.capture_step(),
                                amp_state(), source=user_source()))

    def saw_raise(self, module: nn.Module) -> None:
        """A root call raised instead of returning (a script that catches the error and goes
        on, e.g. skipping a bad batch): the call is dropped, as if it had not been made."""
        w = self._window
        for i in range(len(w.calls) - 1, -1, -1):
            if w.calls[i].module is module and w.calls[i].output is None:
                del w.calls[i]
                return

    def saw_output(self, module: nn.Module, kwargs: dict[str, Any], output: Any) -> None:
        """A root call returned (the global forward hook, at depth 0, `with_kwargs`: global
        pre-hooks are not given the keyword arguments, this hook is)."""
        w = self._window
        for call in reversed(w.calls):
            if call.module is module and call.output is None:
                call.output = weak_tree(output)
                if kwargs:
                    call.kwargs = dict(kwargs)
                    call.versions += flat_versions((), kwargs)
                # A loss the model returns (`out.loss`) may be backpropagated scaled
                # (`out.loss / accum_steps`): tagged like a loss call, for the expression.
                for path, value in _scalars(output):
                    if len(w.losses) >= MAX_CALLS:
                        break
                    loss = LossCall(None, call, path, None, (), {}, [], call.amp,
                                    weakref.ref(value), source=call.source)
                    w.losses.append(loss)
                    loss_expr.tag(value, loss)
                return

    def _saw_loss(self, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: Any) -> None:
        """A `torch.nn.functional` loss returned (its wrapper): where its input came from."""
        try:
            w = self._window
            if not torch.is_grad_enabled() or len(w.losses) >= MAX_CALLS:
                return
            kwargs = dict(kwargs)
            x = args[0] if args else kwargs.pop("input", None)
            if not isinstance(x, torch.Tensor) or not x.requires_grad:
                return  # (`requires_grad`, not `grad_fn`: no autograd node object made here)
            for call in reversed(w.calls):
                output = live_tree(call.output)
                found = find_path(output, x) if output is not None else None
                if found is None:
                    continue
                path, shape = found
                if shape is not None and not (x.is_contiguous()
                                              and select_path(output, path).is_contiguous()):
                    return  # a transpose or permute: not what a reshape gives back
                rest = tuple(args[1:])
                loss = LossCall(fn, call, path, shape, rest, kwargs, flat_versions(rest, kwargs),
                                amp_state(), weakref.ref(out) if isinstance(out, torch.Tensor)
                                else None, source=user_source())
                w.losses.append(loss)
                if isinstance(out, torch.Tensor):
                    # The loss value itself may be a temporary (`F.mse_loss(...) / k`): its
                    # autograd node outlives it, and carries this tag to the backward.
                    loss_expr.tag(out, loss)
                return
        except Exception:  # noqa: BLE001, S110 - never in the script's way
            pass

    def saw_backward(self, tensor: torch.Tensor) -> None:
        """The script calls `tensor.backward()`: which recorded loss (or output) it is. The
        outputs and loss values are let go afterwards."""
        w = self._window
        try:
            w.target = self._target(w, tensor)
        except Exception:  # noqa: BLE001 - never in the script's way: the step is not replayed
            w.target, w.dropped = None, True
        for call in w.calls:
            call.output = None
        for loss in w.losses:
            loss.result = None
        # The next forward is the next micro-batch's (or the next step's).
        w.micro.append(w)
        self._window = _Window(w.micro)

    def unscaled(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Right after `saw_backward(tensor)`: `tensor` in its recorded loss's units when the
        backward took that loss scaled (`loss_expr.unscale`; one device op, no read), else
        None."""
        micro = self._window.micro
        expr = micro[-1].target if micro else None
        return loss_expr.unscale(expr, tensor.detach()) if expr is not None else None

    @staticmethod
    def _target(w: _Window, tensor: torch.Tensor) -> Target:
        """What `tensor` (backpropagated) is: a recorded loss, an expression over them, an
        element of a call's output, or None."""
        target = next((c for c in reversed(w.losses)
                       if c.result is not None and c.result() is tensor), None)
        if target is None:
            target = loss_expr.parse(tensor, w.losses)
        if target is None:
            for call in reversed(w.calls):
                output = live_tree(call.output)
                found = find_path(output, tensor) if output is not None else None
                if found is not None and found[1] is None:
                    return (call, found[0])
        return target

    # ------------------------------------------------------------------ step boundaries

    def boundary(self, roots: list[nn.Module], *, closure: bool,
                 first_call: Any = None) -> Recipe | ClosureRecipe | MicroRecipes | str:
        """An optimizer step starts: the recipe of the step that led to it, or why there is
        none. The window starts afresh. With a closure that the runner calls first itself
        (`first_call`, before anything else draws random numbers): a `ClosureRecipe`."""
        w, self._window = self._window, _Window()
        if closure and first_call is not None:
            return ClosureRecipe(first_call, rng.capture_step(), amp_state())
        if closure:
            return ("the optimizer takes a closure it calls itself (not a torch.optim "
                    "optimizer: its forward runs inside step())")
        if not w.micro:
            return "0 backward() calls in a step"
        if len(w.micro) > 1 and not all(m.calls for m in w.micro):
            return f"{len(w.micro)} backward() calls in a step, not one per forward"
        parts = [_recipe(m, roots) for m in w.micro]
        reason = next((r for r in parts if isinstance(r, str)), None)
        if reason is not None:
            return reason
        recipes = cast(list[Recipe], parts)
        return recipes[0] if len(recipes) == 1 else MicroRecipes(recipes)


_NOT_A_LOSS = ("the loss backpropagated is not a torch.nn.functional loss (or loss module) of "
               "the model's output, nor an element of that output")


def _recipe(w: _Window, roots: list[nn.Module]) -> Recipe | str:
    """The recipe of one backward's window (the forward calls before it), or why none."""
    calls = [c for c in w.calls if any(c.module is r for r in roots)]
    if w.dropped:
        return f"more than {MAX_CALLS} module calls in a step (or a loss not understood)"
    if not calls:
        return ("no grad-enabled call of a module holding the trained parameters in that "
                "step (raw tensors outside any module?)")
    target = w.target
    several = "the model is called several times in a step (before one backward())"
    if isinstance(target, tuple) and isinstance(target[0], RootCall):  # an output element
        if len(calls) > 1:
            return f"{several} and returns its loss"
        if target[0] is calls[0]:
            return Recipe(calls[0], None, cast(tuple[Any, ...], target[1]))
        return _NOT_A_LOSS
    if target is None:
        if len(calls) > 1:
            return f"{several} and its loss is not a sum of recognised losses of its outputs"
        return Recipe(calls[0], None, forward_only=_NOT_A_LOSS)
    losses = cast(list[LossCall], loss_expr.leaves(target))
    used = {id(x.call) for x in losses}
    if not used <= {id(c) for c in calls}:
        return _NOT_A_LOSS  # a loss of another model's output (the generator's step of a GAN)
    if len(calls) > 1 and any(id(c) not in used for c in calls):
        return f"{several} and not every call's output reaches a recognised loss"
    if isinstance(target, LossCall):
        return Recipe(calls[0], target)
    return Recipe(calls[0], None, expr=target, calls=tuple(calls) if len(calls) > 1 else ())


@contextlib.contextmanager
def replay_forward() -> Iterator[None]:
    """Mark a replay's forward (and loss) as nanguard's own while it runs."""
    REPLAY.forward = True
    try:
        yield
    finally:
        REPLAY.forward = False


def mark_replayed_loss(loss: torch.Tensor) -> None:
    """The replay returned `loss`: its `backward()` is nanguard's, not the script's."""
    REPLAY.loss = weakref.ref(loss)
