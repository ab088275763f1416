"""The in-process replay of `nanguard run`: each step's forward and loss, kept by reference.

A script run by `nanguard run` never hands nanguard a `replay(batch) -> loss` function, so the
zero-code runner used to find an origin by re-running the whole script up to the failing step.
`StepRecorder` instead records, while the script runs, what re-executing a step's forward and
loss needs, and `Recipe.run()` is then the `replay` function the `Guard` calls at the first
non-finite step, before the update (pinpoint/inprocess.py). What is kept per step:

* the trained model's root call: the module, its positional and keyword arguments (the global
  forward pre-hook gives the positional ones, the global forward hook, `with_kwargs`, the
  keywords), the version counters of the tensors among them, the torch RNG states and the
  autocast state when it started;
* the loss: the `torch.nn.functional` loss call (loss modules call these too) caught by the
  wrappers of audit/preflight_live.py (`LOSS_FUNCTIONS`, `_find`: the same mechanism), with its
  other arguments and how its input came from the output (the output itself, or a contiguous
  view / reshape of it); or the output element itself when the model returns its loss;
* which of them each `backward()` of the step took: the loss itself, an element of the output,
  or an expression over recorded losses (pinpoint/loss_expr.py: `loss / k` of gradient
  accumulation, a GradScaler's `scaler.scale(loss)`, a discriminator's
  `bce(D(real), 1) + bce(D(fake), 0)`), read from the autograd graph before the backward
  frees its constants.

Everything is held by reference (no copies, no device reads): the arguments until the step's
update (at most `_MAX_CALLS` calls per backward), the outputs only weakly (a grad-enabled
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

While a replay runs, `replaying()` (integrations/manual.py) is true for its forward and for the
`backward()` of the loss it returned, so that the step-boundary hooks of the runner
(`Discovery`, `ManualBoundaries`) do not take nanguard's own forward and backward for the
script's.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from nanguard.audit.preflight_live import LOSS_FUNCTIONS, _find, _select, _versions, _wrap
from nanguard.integrations.manual import REPLAY, forked, replaying
from nanguard.pinpoint import loss_expr
from nanguard.watch import rng

_MAX_CALLS = 8
"""Root calls and loss calls kept per step; more than that is not a simple step anyway."""
_AMP_DEVICES = ("cpu", "cuda")


class NotReplayable(Exception):  # noqa: N818 - the word users read in `replay.in_process`
    """This step cannot be replayed in process; the message says why in one line."""


_ANY_AMP = getattr(torch._C, "_is_any_autocast_enabled", None)


def _amp_state() -> tuple[tuple[str, torch.dtype], ...]:
    """The autocast devices on and their dtypes (one C call when none is: the usual case)."""
    if _ANY_AMP is not None and not _ANY_AMP():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in _AMP_DEVICES
                 if torch.is_autocast_enabled(d))


def _rng_state() -> dict[str, Any]:
    """`rng.capture_step()` without its `torch.cuda.is_available()` (on the hot path: once per
    step); the same dict, for `rng.restore`."""
    state: dict[str, Any] = {"torch": torch.default_generator.get_state()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@contextlib.contextmanager
def _amp(state: tuple[tuple[str, torch.dtype], ...]) -> Iterator[None]:
    """Autocast as it was when the call was recorded (off for the devices it was off for)."""
    with contextlib.ExitStack() as stack:
        for d in _AMP_DEVICES:
            dtype = dict(state).get(d)
            stack.enter_context(torch.autocast(d, dtype=dtype, enabled=dtype is not None))
        yield


def _flat_versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, int]]:
    """`_versions(args, kwargs)`, without its recursion for the usual flat call (on the hot
    path: once per root call)."""
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append((v, v._version))
        elif isinstance(v, (tuple, list, dict)):
            out += _versions(v)
    return out


def _weak(obj: Any, depth: int = 0) -> Any:
    """`obj` (a module's output) with weak references in place of its tensors, to the depth
    `_find` looks (tuples and lists become tuples, mappings dicts: the same paths select)."""
    if isinstance(obj, torch.Tensor):
        return weakref.ref(obj)
    if depth >= 2:
        return None
    if isinstance(obj, (tuple, list)):
        return tuple(_weak(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return {k: _weak(v, depth + 1) for k, v in obj.items()}
    return None


def _live(obj: Any) -> Any:
    """The tensors of a `_weak` structure that are still alive (None for the others)."""
    if isinstance(obj, weakref.ref):
        return obj()
    if isinstance(obj, tuple):
        return tuple(_live(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _live(v) for k, v in obj.items()}
    return None


def _batch_of(args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors `Discovery` hands the guard as the batch of a root call."""
    return tuple(a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0)


@dataclass(eq=False)
class RootCall:
    """One grad-enabled call of a root module."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]
    rng: dict[str, Any]
    amp: tuple[tuple[str, torch.dtype], ...]
    output: Any = None
    """The output as weak references (`_weak`), until the step's backward: the loss input is
    looked up in it."""


@dataclass(eq=False)
class LossCall:
    """One `torch.nn.functional` loss whose input came from a root call's output."""

    fn: Any
    call: RootCall
    path: tuple[Any, ...]
    shape: tuple[int, ...] | None
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]
    amp: tuple[tuple[str, torch.dtype], ...]
    result: weakref.ref[torch.Tensor] | None = None
    """The loss value, weakly, until the step's backward (compared by identity)."""


@dataclass(eq=False)
class Recipe:
    """How to compute one recorded step's loss again: call the module, take the loss."""

    call: RootCall
    loss: LossCall | None
    path: tuple[Any, ...] = ()
    """Without `loss`: where the loss sits in the output (a model that returns its loss)."""
    forward_only: str | None = None
    """The loss is the script's own arithmetic (not recognised): only the forward is replayed,
    and only an origin whose value reached the model's output counts; this says why."""
    expr: Any = None
    """The loss backpropagated as an expression over recorded losses (`loss_expr`), when it
    is not `loss` itself: one times or divided by a constant, a sum of several."""
    calls: tuple[RootCall, ...] = ()
    """The model calls `expr` needs, in the script's order, when there are several (a
    discriminator called on real and on fake data); empty: `call` alone."""

    def _losses(self) -> list[LossCall]:
        if self.expr is not None:
            return cast(list[LossCall], loss_expr.leaves(self.expr))
        return [self.loss] if self.loss is not None else []

    def matches(self, batch: Any) -> bool:
        """`batch` is the one the guard was handed for this step (the same tensors as one of
        the calls' arguments)."""
        theirs = () if batch is None else (
            tuple(batch) if isinstance(batch, (tuple, list)) else (batch,))
        for call in self.calls or (self.call,):
            mine = _batch_of(call.args)
            if len(theirs) == len(mine) and all(a is b for a, b in zip(theirs, mine,
                                                                        strict=True)):
                return True
        return False

    def sample_of(self, batch: Any) -> int | None:
        """`batch` is one sample of this step's batch (`batch[i:i+1]` of each of its tensors,
        as the guard slices it to find a spike's samples): its index `i`, else None (also for
        a step of several model calls)."""
        mine = _batch_of(self.call.args)
        theirs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if self.calls or not mine or len(theirs) != len(mine):
            return None
        index = None
        for t, r in zip(theirs, mine, strict=True):
            i = _row_of(t, r)
            if i is None or (index is not None and i != index):
                return None
            index = i
        return index

    def run(self, sample: int | None = None) -> torch.Tensor:
        """The step's forwards and loss again, each forward from the RNG states it started
        with; with `sample`, of that sample of the batch alone (the batch's tensors and the
        loss's per-sample arguments sliced to it).

        Raises:
            NotReplayable: a tensor of the batch or the targets changed in place since, or
                torch.distributed is initialized, or a sample's loss of a forward replayed
                alone is asked for.
        """
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Asked here, not at every step boundary: only a replay needs to know.
            raise NotReplayable("torch.distributed: a replayed backward would wait for the "
                                "other ranks")
        losses = self._losses()
        calls = self.calls or (self.call,)
        versions = [v for c in calls for v in c.versions] + [v for x in losses for v in x.versions]
        if any(t._version != v for t, v in versions):
            raise NotReplayable("the script changed the batch in place after the forward")
        if sample is not None and (self.forward_only is not None or not losses):
            raise NotReplayable("no per-sample loss: the loss is not a recognised one of the "
                                "model's output")
        n = len(_batch_of(self.call.args)[0]) if sample is not None else 0
        outputs: dict[int, Any] = {}
        for call in calls:
            rng.restore(call.rng)
            args, kwargs = call.args, call.kwargs
            if sample is not None:
                args, kwargs = _rows(args, n, sample), _rows(kwargs, n, sample)
            with _amp(call.amp):
                outputs[id(call)] = call.module(*args, **kwargs)
        out = outputs[id(self.call)]
        if self.forward_only is not None:
            return _forward_result(out, self.forward_only)
        if not losses:
            return cast(torch.Tensor, _select(out, self.path))

        def value_of(loss: LossCall) -> torch.Tensor:
            x = _select(outputs[id(loss.call)], loss.path)
            rest, extra, shape = loss.rest, loss.kwargs, loss.shape
            if sample is not None:
                rest, extra = _rows(rest, n, sample), _rows(extra, n, sample)
                if shape is not None and shape and shape[0] % n == 0:
                    shape = (shape[0] // n, *shape[1:])  # logits.view(-1, V): a sample's rows
            if shape is not None:
                x = x.reshape(shape)
            with _amp(loss.amp):
                return cast(torch.Tensor, loss.fn(x, *rest, **extra))

        if self.expr is None:
            return value_of(losses[0])
        return loss_expr.evaluate(self.expr, value_of)


def _row_of(t: Any, r: torch.Tensor) -> int | None:
    """`t` is `r[i:i+1]` (a view of one row of `r`): `i`, else None."""
    if not isinstance(t, torch.Tensor) or t.dim() != r.dim() or t.shape[0] != 1 \
            or t.shape[1:] != r.shape[1:] or r.stride(0) == 0:
        return None
    try:
        if t.untyped_storage().data_ptr() != r.untyped_storage().data_ptr():
            return None
    except (RuntimeError, NotImplementedError):
        return None
    i, rem = divmod(int(t.storage_offset()) - int(r.storage_offset()), int(r.stride(0)))
    return i if rem == 0 and 0 <= i < r.shape[0] else None


def _rows(obj: Any, n: int, i: int) -> Any:
    """`obj` (arguments) with each tensor whose leading dimension is the batch's `n` sliced to
    row `i`, and each whose leading dimension is a multiple `k * n` of it (targets flattened
    batch-major, `targets.view(-1)`) to that row's `k` entries; other values as they are."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] % n:
            return obj
        k = obj.shape[0] // n
        return obj[i * k:(i + 1) * k]
    if isinstance(obj, tuple):
        return tuple(_rows(v, n, i) for v in obj)
    if isinstance(obj, list):
        return [_rows(v, n, i) for v in obj]
    if isinstance(obj, dict):
        return {k: _rows(v, n, i) for k, v in obj.items()}
    return obj


@dataclass(eq=False)
class MicroRecipes:
    """A step of gradient accumulation: one recipe per `backward()` (micro-batch), in order.
    The guard replays its micro-batches one by one (pinpoint/step_replay.py); each is
    computed again by the recipe whose batch it is."""

    parts: list[Recipe]

    def part(self, batch: Any) -> Recipe | None:
        """The recipe of micro-batch `batch` (or of the micro-batch `batch` is a sample of),
        or None."""
        return next((r for r in self.parts
                     if r.matches(batch) or r.sample_of(batch) is not None), None)

    def matches(self, batch: Any) -> bool:
        return self.part(batch) is not None


class _KeptCells:
    """The closure's variables as they were before a replay of it, put back afterwards: the
    ones it closes over and the globals its code names (a `global calls; calls += 1` counter,
    a list of losses it appends to, rebound or changed in place, one level deep). Replaying
    the closure must not change what the script sees. Python state reached otherwise
    (attributes of objects, the contents of nested containers) is not restored."""

    def __init__(self, fn: Any) -> None:
        self.saved: list[tuple[Any, Any, Any]] = []
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            self.saved.append((cell, value, _shallow(value)))
        self.globals: list[tuple[str, Any, Any]] = []
        self.scope: dict[str, Any] = {}
        scope = getattr(fn, "__globals__", None)
        code = getattr(fn, "__code__", None)
        if isinstance(scope, dict) and code is not None:
            self.scope = scope
            self.globals = [(n, scope[n], _shallow(scope[n])) for n in code.co_names
                            if n in scope]

    def restore(self) -> None:
        for name, value, copy in self.globals:
            if self.scope.get(name) is not value:
                self.scope[name] = value
            _put_back(value, copy)
        for cell, value, copy in self.saved:
            cell.cell_contents = value
            _put_back(value, copy)


def _shallow(value: Any) -> Any:
    return list(value) if isinstance(value, list) else (
        dict(value) if isinstance(value, dict) else None)


def _put_back(value: Any, copy: Any) -> None:
    """`value` (a list or dict) back to its shallow `copy` if it changed."""
    if isinstance(value, list) and copy is not None and (
            len(value) != len(copy) or any(a is not b for a, b in zip(value, copy, strict=True))):
        value[:] = copy
    elif isinstance(value, dict) and copy is not None and (
            value.keys() != copy.keys() or any(value[k] is not copy[k] for k in copy)):
        value.clear()
        value.update(copy)


@dataclass(eq=False)
class ClosureRecipe:
    """How to compute one `optimizer.step(closure)` step's loss again: call the closure (it runs
    forward, loss and backward itself), from the RNG and autocast states its first call started
    with. The runner calls that first call itself before the guard checks the step
    (integrations/discovery.py), so the parameters are still those it saw."""

    closure: Any
    rng: dict[str, Any]
    amp: tuple[tuple[str, torch.dtype], ...]
    batch: Any = None
    """The batch the guard was handed for this step (set by the runner)."""

    def matches(self, batch: Any) -> bool:
        """`batch` is the step's own (a single sample of it is not: the closure takes none)."""
        if batch is None or self.batch is None:
            return batch is None and self.batch is None
        a = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        b = tuple(self.batch) if isinstance(self.batch, (tuple, list)) else (self.batch,)
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))

    def run(self) -> torch.Tensor:
        """The closure again; its loss is marked as already backpropagated.

        Raises:
            NotReplayable: torch.distributed is initialized, or the closure returned no tensor.
        """
        import io

        from nanguard.pinpoint.inprocess import mark_backpropagated

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            raise NotReplayable("torch.distributed: a replayed backward would wait for the "
                                "other ranks")
        kept = _KeptCells(self.closure)
        rng.restore(self.rng)
        try:
            # The closure's prints (a loss log) are the replay's, not the script's: dropped.
            with _amp(self.amp), contextlib.redirect_stdout(io.StringIO()):
                out = self.closure()
        finally:
            kept.restore()
        if isinstance(out, (tuple, list)) and out:
            out = out[0]
        if not isinstance(out, torch.Tensor):
            raise NotReplayable("the closure returned no loss tensor")
        mark_backpropagated(out)
        return out


def _forward_result(out: Any, why: str) -> torch.Tensor:
    """The model's output of a forward replayed alone, marked so that no backward runs on it.
    Only a non-finite output is taken: then the first non-finite value of the step was made in
    the forward (nothing of the step runs before it) and reached the loss, so the checker's
    origin is exact. A finite output (nothing non-finite, or a value the forward itself cut
    off, such as a -inf that a gather skipped) says nothing of the loss: refused.

    Raises:
        NotReplayable: the replayed forward's output is finite.
    """
    from nanguard.pinpoint.inprocess import mark_backpropagated

    tensors = [t for t in _flat(out) if t.is_floating_point() and t.numel()]
    with torch.no_grad():
        bad = next((t for t in tensors if not bool(torch.isfinite(t).all())), None)
    if bad is None:
        raise NotReplayable(f"{why}; its forward alone, replayed, gives a finite output (the "
                            "value is made in the loss or the backward)")
    mark_backpropagated(bad, comparable=False)
    return bad


def _flat(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth >= 2:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in _flat(v, depth + 1)]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _flat(v, depth + 1)]
    return []


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

        me = cast(Any, weakref.ref(self))  # `_wrap` calls `.done` and `._saw_loss` on it
        for name in LOSS_FUNCTIONS:
            original = getattr(F, name, None)
            if original is None or name in self._patched:
                continue
            self._patched[name] = original
            setattr(F, name, _wrap(name, original, me))
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
        """The loss wrappers' question (`preflight_live._wrap`): ignore this call?"""
        return self.paused or forked() or replaying()

    # ------------------------------------------------------------------ what the script does

    def saw_call(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """A grad-enabled call of a root module with parameters starts (the global forward
        pre-hook): its positional arguments, RNG and autocast states."""
        w = self._window
        if len(w.calls) >= _MAX_CALLS:
            w.dropped = True
            return
        w.calls.append(RootCall(module, args, {}, _flat_versions(args, {}), _rng_state(),
                                _amp_state()))

    def saw_output(self, module: nn.Module, kwargs: dict[str, Any], output: Any) -> None:
        """A root call returned (the global forward hook, at depth 0, `with_kwargs`: global
        pre-hooks are not given the keyword arguments, this hook is)."""
        for call in reversed(self._window.calls):
            if call.module is module and call.output is None:
                call.output = _weak(output)
                if kwargs:
                    call.kwargs = dict(kwargs)
                    call.versions += _flat_versions((), kwargs)
                return

    def _saw_loss(self, name: str, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  out: Any) -> None:
        """A `torch.nn.functional` loss returned (its wrapper): where its input came from."""
        try:
            w = self._window
            if not torch.is_grad_enabled() or len(w.losses) >= _MAX_CALLS:
                return
            kwargs = dict(kwargs)
            x = args[0] if args else kwargs.pop("input", None)
            if not isinstance(x, torch.Tensor) or not x.requires_grad:
                return  # (`requires_grad`, not `grad_fn`: no autograd node object made here)
            for call in reversed(w.calls):
                output = _live(call.output)
                found = _find(output, x) if output is not None else None
                if found is None:
                    continue
                path, shape = found
                if shape is not None and not (x.is_contiguous()
                                              and _select(output, path).is_contiguous()):
                    return  # a transpose or permute: not what a reshape gives back
                rest = tuple(args[1:])
                loss = LossCall(fn, call, path, shape, rest, kwargs, _flat_versions(rest, kwargs),
                                _amp_state(), weakref.ref(out) if isinstance(out, torch.Tensor)
                                else None)
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
                output = _live(call.output)
                found = _find(output, tensor) if output is not None else None
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
            return ClosureRecipe(first_call, _rng_state(), _amp_state())
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
        return f"more than {_MAX_CALLS} module calls in a step (or a loss not understood)"
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
