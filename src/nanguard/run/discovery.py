"""Find the optimizers, models, losses and batches of a script that knows nothing of nanguard.

`Discovery` installs PyTorch's global hooks while an unmodified script runs (`nanguard run`):

* a global optimizer step pre-hook: the first time an optimizer steps, a `Guard` is attached to
  it (its own hooks then run in that same step: global pre-hooks run before per-optimizer ones);
* global module forward pre/post hooks: the root modules (called while no other module's forward
  runs) and the first tensor arguments of each root's forward, i.e. the batch (run/root_calls.py);
* a wrapper around `torch.Tensor.backward`: the scalar being backpropagated is the loss
  (run/patches.py, with the wrappers of `clip_grad_norm_` and of process starts);
* `ManualBoundaries` (run/manual.py): while the script has no optimizer at all
  (hand-written updates), the step boundaries come from `backward()` through a no-op
  `ManualStep` optimizer, which gets a guard like any other;
* `optimizer.step(closure)` (LBFGS and every torch.optim optimizer): the global pre-hook runs
  the closure once itself, before the guard's own pre-hook (run/closures.py).

Hooks inherited by a forked child (DataLoader workers, Hogwild trainers started with
`torch.multiprocessing`) do nothing there; `processes_started` counts the worker processes
started, so a run that watched nothing can say why.

The model given to a guard is the root module that holds the optimizer's parameters
(run/watched.py), its batch the first input of that model's forward since the optimizer's
previous step that no other module produced (run/root_calls.py). Every hook and patch is
removed by `remove()`; nothing here reads a device value on the host.

With a `preflight` (`nanguard run --preflight`, audit/preflight_live.py) the hooks also tell it
the root forwards, their outputs and the loss backpropagated, and the first optimizer step runs
it before any guard is attached, with every hook here quiet (`quiet()`: the copies it trains
must not count as the script's forwards, losses or steps); its verdict goes into the guards'
`RunFacts` (the diagnosis reads it).

The guards and what they are given are made in run/attach.py (`Guards`); this module holds
the hooks and what they share (the last loss, the step count).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from nanguard.config import GuardConfig, RecordConfig
from nanguard.guard import Guard
from nanguard.pinpoint.recorded import ClosureRecipe, StepRecorder
from nanguard.run import held, resume_state
from nanguard.run.amp_scalers import ScalerTracker, served
from nanguard.run.attach import Guards
from nanguard.run.closures import calls_closure_first, closure_of, run_closure_first
from nanguard.run.manual import ManualBoundaries, ManualStep, forked, replaying
from nanguard.run.patches import Undo, count_process_starts, wrap_backward, wrap_clip
from nanguard.run.resume import ResumePoints
from nanguard.run.root_calls import Batch, RootCalls
from nanguard.run.watched import Watched
from nanguard.step.failopen import fail_open
from nanguard.watch import loads


class Discovery:
    """Attach guards to whatever optimizers a script steps; see the module docstring.

    Args:
        folder_for: gives the run folder of the n-th optimizer found (called when it is found).
        policy: the guards' policy.
        config: base guard config (its `record.out` and `policy` are overridden).
        preflight: a `LivePreflight` to feed and run at the first optimizer step, or None.
    """

    def __init__(
        self,
        folder_for: Callable[[int], Path],
        *,
        policy: str = "observe",
        config: GuardConfig | None = None,
        preflight: Any = None,
    ) -> None:
        self.preflight = preflight
        self._quiet = False
        self.error: dict[str, Any] | None = None
        """An error of nanguard's own in these hooks (`stand_down`): they do nothing since."""
        self.guards = Guards(folder_for, policy=policy, preflight=preflight,
                             config=config or GuardConfig(record=RecordConfig(summary=False)))
        self.watched = self.guards.watched
        """Each optimizer found, with its guard (run/attach.py)."""
        self.clipped: tuple[frozenset[int], Any] | None = None
        """The parameters and total norm of the script's last `clip_grad_norm_` call, handed
        to the guard of the next optimizer step over them (`Guard.note_clip_norm`)."""
        self._calls = RootCalls()
        self._loss: torch.Tensor | None = None
        self._loss_seq = 0
        self._steps = 0
        self._in_step = False
        """Between an optimizer step's pre- and post-hooks (a closure's backwards run there)."""
        self.resume: ResumePoints | None = None
        """Resume points (run/resume.py): offered every backward outside a step."""
        self._handles: list[RemovableHandle] = []
        self._backward: Any = None
        """The original `Tensor.backward` while the wrapper is installed."""
        self._undo: list[Undo] = []
        self._manual = ManualBoundaries(
            roots=self._calls.roots,
            on_error=lambda exc: self.stand_down(exc, "nanguard run's hand-written step "
                                                       "boundaries"))
        self.recorder = StepRecorder()
        self.processes_started = 0
        self._amp = ScalerTracker(self._scaler_update,
                                  active=lambda: not forked() and not self._quiet)

    # ------------------------------------------------------------------ install / remove

    def install(self) -> Discovery:
        """Install the global hooks and the wrappers (the module docstring lists them), before
        the script runs; `remove()` undoes every one. Returns this object."""
        self._handles = [
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_module_forward_pre_hook(self._forward_pre),
            # with_kwargs: the in-process replay calls a root again with its keywords too.
            register_module_forward_hook(self._forward_post, with_kwargs=True, always_call=True),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self.recorder.install()  # before the preflight's loss wrappers (removed after them)
        self._backward = torch.Tensor.backward
        self._undo = [wrap_backward(self._saw_backward)]
        self._manual.install()  # wraps the wrapper: a boundary ends before the loss is taken
        self._undo.append(count_process_starts(self._process_started))
        # State loaded before the first optimizer step (a resume) is loaded before any guard
        # exists: remember the line that loaded it, for a non-finite value found there.
        loads.track()
        # Guard states saved with the script's checkpoints, restored when it resumes.
        self._undo.append(resume_state.track(lambda: self.watched))
        # The script's own clip setting, so a fix can say "your clip is off" in its terms.
        self._undo.append(wrap_clip(self.guards.note_clip, self._clip_done))
        self._amp.install()
        if self.preflight is not None:
            self.preflight.install()
        return self

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Every hook of this object does nothing, and `Tensor.backward` is the original one
        (the hand-written-update boundaries wrap it too), while the preflight trains its
        copies inside a step of the script."""
        self._quiet = self.recorder.paused = True
        current = torch.Tensor.backward
        if self._backward is not None:
            torch.Tensor.backward = self._backward  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.backward = current  # type: ignore[method-assign]
            self._quiet = self.recorder.paused = False

    @property
    def steps_started(self) -> int:
        """Optimizer steps started so far, all optimizers together (what `armed` counts)."""
        return self._steps

    def finish(self) -> None:
        """At the end of the script (also after an error): end a pending hand-written step."""
        if not forked():
            self._manual.finish()

    def remove(self) -> None:
        """Remove every global hook and the `backward` patch (idempotent)."""
        from torch.nn.modules import module as _module

        for h in self._handles:
            h.remove()
            # torch keeps a `with_kwargs` hook's id after its handle is removed: every later
            # `torch.compile(module)` of the process would then warn of a global hook.
            _module._global_forward_hooks_with_kwargs.pop(h.id, None)
        self._handles = []
        if self.preflight is not None:
            self.preflight.remove()
        self.recorder.remove()
        loads.untrack()
        self._amp.remove()
        self._manual.remove()
        # Undone in reverse: `Tensor.backward` last, as the boundaries above wrapped it.
        while self._undo:
            self._undo.pop()()
        self._backward = None
        self._calls.clear()

    def stand_aside(self) -> None:
        """In a fork that goes on with the script (a resume point's child): every hook of
        this object and of its guards removed and nothing written or closed: the stores,
        their writer threads and the run folders are the parent's."""
        self._quiet = self.recorder.paused = True
        self._manual.stand_aside()
        for w in self.watched:
            if w.guard is not None:
                w.guard.detach()
        self.remove()

    def stand_down(self, exc: BaseException, where: str) -> None:
        """An error inside the runner's own hooks: every guard stands down (its error and
        traceback recorded, its hooks removed: status `degraded`), these hooks do nothing from
        now on, and the script runs on exactly as without nanguard."""
        self.error = {"where": where, "error": f"{type(exc).__name__}: {exc}"}
        guards = [w.guard for w in self.watched if w.guard is not None]
        for guard in guards:
            guard.stand_down(exc, where)
        if not guards:
            print(f"nanguard: internal error in {where} ({type(exc).__name__}: {exc}); "
                  "nanguard stands down, training goes on", file=sys.stderr)

    def release(self) -> None:
        """Drop the references kept for the end-of-run checks (the last loss)."""
        self._loss = None
        self._calls.release()

    # ------------------------------------------------------------------ end-of-run evidence

    def nonfinite_evidence(self, *, on_error: bool, tb: TracebackType | None = None
                           ) -> dict[str, Any] | None:
        """Whether the script saw a non-finite value that no guarded step recorded: the last
        loss backpropagated after the last step, or the last outputs of grad-enabled root
        forwards (a NaN; on the error path also an Inf: an error such as BCE's "all elements
        of input should be between 0 and 1" follows from it). Called once, when the script has
        ended (a few host reads); never on the hot path.

        With `tb`, the traceback of the exception the script died of: when nothing else
        held one, the tensors held by the module frames it unwound through
        (run/held.py: a forward that raised on its own NaN check).

        Returns:
            `{"signals": [...], "module": ...}` naming what held the value (with `phase` when
            a raised forward held it), or None.
        """
        signals: list[str] = []
        module = None
        unconsumed = all(self._loss_seq > w.loss_seq for w in self.watched)
        if self._loss is not None and unconsumed and not bool(torch.isfinite(self._loss).all()):
            signals.append("loss")
        for name in self._calls.nonfinite_outputs(on_error=on_error):
            signals.append(f"output of {name}")
            module = module or name
        if not signals:
            return held.nonfinite_locals(tb, self._calls.roots()) if tb is not None else None
        return {"signals": signals, "module": module}

    # ------------------------------------------------------------------ hooks

    @fail_open("nanguard run's backward hook")
    def _saw_backward(self, tensor: torch.Tensor) -> None:
        if forked() or self._quiet or replaying(tensor):
            return
        if self.resume is not None and not self._in_step:
            self.resume.at_backward(self._steps, manual=self._manual.enabled
                                    and self._manual.optimizer is not None)
            if self._quiet:  # a resume point's child, going on with the script
                return
        if self.preflight is not None and not self.preflight.done:
            self.preflight.saw_backward(tensor)
        self.recorder.saw_backward(tensor)
        self._calls.next_micro_batch()
        if tensor.numel() == 1 and tensor.is_floating_point():
            # A loss scaled for its backward (`loss / accum_steps`, `scaler.scale(loss)`) is
            # recorded in the script's units: the loss series is the loss, not its copy.
            unscaled = self._amp.unscaled(tensor)
            if unscaled is None:
                unscaled = self.recorder.unscaled(tensor)
            self._loss = unscaled if unscaled is not None else tensor.detach()
            self._loss_seq += 1

    def _process_started(self) -> None:
        self.processes_started += 1

    def _clip_done(self, params: list[torch.Tensor], total: Any) -> None:
        """...and it clipped `params` to `total`: for the next optimizer step over them."""
        self.clipped = (frozenset(map(id, params)), total)

    @fail_open("nanguard run's forward pre-hook")
    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if forked() or self._quiet or replaying():
            return
        if not self._calls.enter(module):
            return
        if not torch.is_grad_enabled():
            return  # evaluation (`no_grad`): not a training batch
        if self._calls.holds_params(module):  # a model: recorded for the in-process replay
            self.recorder.saw_call(module, args)
        if self.preflight is not None and not self.preflight.done:
            self.preflight.saw_root_forward(module, args)
        self._calls.saw_inputs(module, args)

    @fail_open("nanguard run's forward hook")
    def _forward_post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        """A module's forward returned: `(module, args, kwargs, output)`. Registered with
        `always_call`, so that the depth count stays right when a forward raises (the script's
        own NaN check, a shape error): torch then calls it while the exception unwinds, as
        `(module, args, result)` without the keywords, and nothing but the count is taken."""
        if forked() or self._quiet or replaying():
            return
        root = self._calls.leave()
        raised = len(rest) != 2
        if raised and root:
            self.recorder.saw_raise(module)
        if not root or raised:
            return
        kwargs, output = rest
        self.recorder.saw_output(module, kwargs, output)
        if kwargs and torch.is_grad_enabled() and self._calls.holds_params(module):
            self._calls.saw_keywords(module, kwargs)
        if self.preflight is not None and not self.preflight.done and torch.is_grad_enabled():
            self.preflight.saw_root_output(module, output)
        self._calls.saw_output(module, output)

    @fail_open("nanguard run's optimizer step pre-hook")
    def _optimizer_pre(self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """Global step pre-hook: runs first in every `optimizer.step()` (and in a
        `ManualStep.begin()`), before the guard's own pre-hook."""
        if forked() or self._quiet:
            return None
        if self.preflight is not None and not self.preflight.done:
            with self.quiet():  # PreflightStop (--preflight-only) passes on from here
                self.preflight.at_first_step(optimizer,
                                             manual=isinstance(optimizer, ManualStep))
        w = self.guards.get(id(optimizer))
        if w is None or w.optimizer is not optimizer:
            w = self._attach(optimizer)
        w.starts.append(self._steps)
        self._steps += 1
        self._in_step = True
        clipped, self.clipped = self.clipped, None
        if isinstance(optimizer, ManualStep):
            # A hand-written update's step is read at the end of its backward, before the
            # script clips: its norms are the clip's own input, and a clip seen now was the
            # step before's (noted here, it was judged one step late).
            clipped = None
        if clipped is not None and w.guard is not None and not w.guard.closed and any(
                id(p) in clipped[0] for g in optimizer.param_groups for p in g["params"]):
            w.guard.note_clip_norm(clipped[1])
        closure = closure_of(args, kwargs)
        w.recipe = self.recorder.boundary(
            w.roots, closure=closure is not None,
            first_call=closure if calls_closure_first(optimizer) else None)
        if w.guard is None or w.guard.closed:
            return None
        result = run_closure_first(optimizer, args, kwargs)
        loss, batches = self._take_step(w)
        if isinstance(w.recipe, ClosureRecipe):
            w.recipe.batch = batches[0] if batches else None
        _hand_over(w.guard, loss, batches)
        return result

    def _take_step(self, w: Watched) -> tuple[torch.Tensor | None, list[Batch]]:
        """`w`'s step: the loss backpropagated since its last step (None: none was), and its
        batches (micro-batches, in order)."""
        loss = self._loss if self._loss_seq > w.loss_seq else None
        w.loss_seq = self._loss_seq
        return loss, self._calls.take_batches(w.roots)

    @fail_open("nanguard run's optimizer step post-hook")
    def _optimizer_post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Global step post-hook: the update is done, the step's recipe is of no more use
        (its batch is let go)."""
        self._in_step = False
        w = self.guards.get(id(optimizer))
        if w is not None and w.optimizer is optimizer:
            if isinstance(w.recipe, ClosureRecipe):
                # The closure's forwards and backwards ran after the boundary: they belong to
                # this step, not to the next one's recording.
                self.recorder.reset()
            w.recipe = None

    @fail_open("nanguard run's GradScaler hook")
    def _scaler_update(self, scaler: Any) -> None:
        """Right before `scaler.update()`, the end of an AMP iteration. An optimizer the scaler
        handled that did not step (inf/NaN gradients: no step hook ran) gets its loss and
        batch handed to its guard here, which counts the skip and keeps the batch for the
        check of what the scaler hid; nothing of that iteration is taken for a micro-batch of
        the next step."""
        skipped = False
        for opt_id in served(scaler):
            w = self.guards.get(opt_id)
            if w is None:  # never stepped yet: skipped from its first iteration on
                skipped = True
                continue
            if len(w.starts) > w.updates_seen:
                w.updates_seen = len(w.starts)
                continue
            skipped = True
            if w.guard is not None and not w.guard.closed:
                _hand_over(w.guard, *self._take_step(w))
        if skipped:
            self._calls.drop_batches()
            self.recorder.reset()

    def attach_unstepped(self) -> Watched | None:
        """At the end of a run that saw a non-finite value before any step was watched: a
        guard for the optimizer the script built but never stepped (or for the hand-written
        updates of the root modules seen), so the finding has a record and a diagnosis."""
        if self.watched:
            return self.watched[0]
        opts = [o for r in self._manual.created if (o := r()) is not None]
        if opts:
            return self._attach(opts[0])
        params = [p for r in self._calls.roots() for p in r.parameters() if p.requires_grad]
        if not params:
            return None
        return self._attach(ManualStep(list(dict.fromkeys(params))))

    # ------------------------------------------------------------------ guards

    def _attach(self, optimizer: torch.optim.Optimizer) -> Watched:
        me = weakref.ref(self)
        return self.guards.attach(optimizer, self._calls.owners(optimizer),
                                  scaler=self._amp.scaler_for(optimizer),
                                  alive=lambda: me() is not None)


def _hand_over(guard: Guard, loss: torch.Tensor | None, batches: list[Batch]) -> None:
    """Give a guard its step. Each micro-batch is handed on in turn: the guard fingerprints
    them all, numbers their samples across them and replays them one by one."""
    guard.watch(loss=loss, batch=batches[0] if batches else None)
    for batch in batches[1:]:
        guard.watch_micro_batch(batch)
