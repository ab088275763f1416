"""Find the optimizers, models, losses and batches of a script that knows nothing of nanguard.

`Discovery` installs PyTorch's global hooks while an unmodified script runs (`nanguard run`):

* a global optimizer step pre-hook: the first time an optimizer steps, a `Guard` is attached to
  it (its own hooks then run in that same step: global pre-hooks run before per-optimizer ones);
* global module forward pre/post hooks: the root modules (called while no other module's forward
  runs) and the first tensor arguments of each root's forward, i.e. the batch;
* a wrapper around `torch.Tensor.backward`: the scalar being backpropagated is the loss;
* `ManualBoundaries` (run/manual.py): while the script has no optimizer at all
  (hand-written updates), the step boundaries come from `backward()` through a no-op
  `ManualStep` optimizer, which gets a guard like any other;
* `optimizer.step(closure)` (LBFGS and every torch.optim optimizer): the global pre-hook runs
  the closure once itself, before the guard's own pre-hook, and hands the optimizer a closure
  whose first call returns that result: the guard checks the gradients the closure made, and
  the optimizer computes exactly what it would have (the same single call, only earlier).

Hooks inherited by a forked child (DataLoader workers, Hogwild trainers started with
`torch.multiprocessing`) do nothing there; `processes_started` counts the worker processes
started, so a run that watched nothing can say why.

The model given to a guard is the root module that holds the optimizer's parameters (several
roots: a `ModuleDict` over them, names prefixed by the root's class). The batch given to a guard
is the first input of its model's forward since that optimizer's previous step that was not
produced by another module's forward (a GAN's discriminator sees `real` and `G(z).detach()`:
`real` is the data). Every hook and patch is removed by `remove()`; nothing here reads a device
value on the host.

With a `preflight` (`nanguard run --preflight`, audit/preflight_live.py) the hooks also tell it
the root forwards, their outputs and the loss backpropagated, and the first optimizer step runs
it before any guard is attached, with every hook here quiet (`quiet()`: the copies it trains
must not count as the script's forwards, losses or steps); its verdict goes into the guards'
`RunFacts` (the diagnosis reads it).

What is kept for each optimizer found (`Watched`), the model its guard is given and the guard's
in-process replay of the recorded step are in run/watched.py; this module holds the
hooks, whose state (roots, inputs, outputs, the last loss, the step count) they share.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
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
from nanguard.pinpoint.recorded import ClosureRecipe, NotReplayable, StepRecorder
from nanguard.run import held
from nanguard.run.amp_scalers import ScalerTracker, served
from nanguard.run.chains import replaced
from nanguard.run.manual import ManualBoundaries, ManualStep, forked, replaying
from nanguard.run.resume import ResumePoints
from nanguard.run.script_flags import clip_from_argv
from nanguard.run.watched import Watched, as_model, holds_compiled, replay_recorded
from nanguard.step.failopen import fail_open
from nanguard.step.state import RunFacts
from nanguard.watch import loads

_MAX_OUTPUTS = 32


@dataclass
class _Inputs:
    data: list[tuple[torch.Tensor, ...] | dict[str, torch.Tensor]] = field(default_factory=list)
    """The batch of each backward() of the step (several: the micro-batches of gradient
    accumulation), in order: the inputs of the first grad-enabled call before it that no
    module produced."""
    taken: bool = False
    """This backward's batch is in `data` already."""
    other: tuple[torch.Tensor, ...] | None = None
    """The first call's inputs when a module produced them (a discriminator fed a generator)."""


class _Coupling:
    """The rollback group of one script's guards (any weak-referenceable object will do)."""


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
        self.folder_for = folder_for
        self.preflight = preflight
        self._quiet = False
        self.error: dict[str, Any] | None = None
        """An error of nanguard's own in these hooks (`stand_down`): they do nothing since."""
        self.policy = policy
        self.config = config or GuardConfig(record=RecordConfig(summary=False))
        self._coupling = _Coupling()
        self._clip: Any = None
        self.script_clip: float | None = None
        """The `max_norm` the script last passed to `clip_grad_norm_` (0: clipping off)."""
        self.facts: RunFacts | None = None
        """How the script runs, given to each of its guards (`Guard(facts=...)`): one object
        made at the first guard, when `sys.argv` is the script's; the clip the script passes
        to `clip_grad_norm_` later is noted there too (the diagnosis reads it at the end)."""
        self.clipped: tuple[frozenset[int], Any] | None = None
        """The parameters and total norm of the script's last `clip_grad_norm_` call, handed
        to the guard of the next optimizer step over them (`Guard.note_clip_norm`)."""
        self.watched: list[Watched] = []
        self._by_opt: dict[int, Watched] = {}
        self._roots: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._inputs: dict[int, _Inputs] = {}
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self._depth = 0
        self._loss: torch.Tensor | None = None
        self._loss_seq = 0
        self._steps = 0
        self._in_step = False
        """Between an optimizer step's pre- and post-hooks (a closure's backwards run there)."""
        self.resume: ResumePoints | None = None
        """Resume points (run/resume.py): offered every backward outside a step."""
        self._handles: list[RemovableHandle] = []
        self._backward: Any = None
        self._train_outputs: list[tuple[str, torch.Tensor]] = []
        """(module class, [has NaN, has Inf]) of the last few grad-enabled root forwards'
        outputs (model output, loss module): two reductions on the device per root forward,
        read only at the end of the run (the outputs themselves are not kept)."""
        self._manual = ManualBoundaries(
            roots=lambda: list(self._roots.values()),
            on_error=lambda exc: self.stand_down(exc, "nanguard run's hand-written step "
                                                       "boundaries"))
        self.recorder = StepRecorder()
        self._has_params: weakref.WeakKeyDictionary[nn.Module, bool] = \
            weakref.WeakKeyDictionary()
        """Per root module seen: whether it holds parameters (a loss module does not)."""
        self._start: Any = None
        self.processes_started = 0
        self._amp = ScalerTracker(self._scaler_update,
                                  active=lambda: not forked() and not self._quiet)

    # ------------------------------------------------------------------ install / remove

    def install(self) -> Discovery:
        self._handles = [
            register_optimizer_step_pre_hook(self._optimizer_pre),
            register_module_forward_pre_hook(self._forward_pre),
            # with_kwargs: the in-process replay calls a root again with its keywords too.
            register_module_forward_hook(self._forward_post, with_kwargs=True, always_call=True),
            register_optimizer_step_post_hook(self._optimizer_post),
        ]
        self.recorder.install()  # before the preflight's loss wrappers (removed after them)
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
        self._manual.install()  # wraps the wrapper: a boundary ends before the loss is taken

        import multiprocessing.process as mp_process

        start = mp_process.BaseProcess.start
        self._start = start

        def counted_start(proc: Any) -> None:
            d = me()
            # A DataLoader's workers load batches, they do not train: not counted (the
            # "training inside worker processes" note would be wrong about them).
            target = getattr(getattr(proc, "_target", None), "__module__", "") or ""
            if (d is not None and not forked()
                    and not target.startswith("torch.utils.data")):
                d.processes_started += 1
            start(proc)

        mp_process.BaseProcess.start = counted_start  # type: ignore[method-assign,assignment]
        # State loaded before the first optimizer step (a resume) is loaded before any guard
        # exists: remember the line that loaded it, for a non-finite value found there.
        loads.track()
        # The script's own clip setting, so a fix can say "your clip is off" in its terms.
        clip = torch.nn.utils.clip_grad_norm_
        self._clip = clip

        def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> Any:
            d = me()
            if d is None or forked():
                return clip(parameters, max_norm, *args, **kwargs)
            d.script_clip = float(max_norm)
            if d.facts is not None:
                d.facts.script_clip = d.script_clip
            # A list, so that the parameters can be told apart after torch has read them (a
            # generator is read once).
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            total = clip(params, max_norm, *args, **kwargs)
            d.clipped = (frozenset(map(id, params)), total)  # for the next optimizer step
            return total

        torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
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
        if self._clip is not None:
            torch.nn.utils.clip_grad_norm_ = self._clip
            self._clip = None
        self._amp.remove()
        self._manual.remove()
        if self._start is not None:
            import multiprocessing.process as mp_process

            mp_process.BaseProcess.start = self._start  # type: ignore[method-assign]
            self._start = None
        if self._backward is not None:
            torch.Tensor.backward = self._backward  # type: ignore[method-assign]
            self._backward = None
        self._outputs.clear()
        self._inputs.clear()

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
        self._train_outputs.clear()

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
        for name, flags in reversed(self._train_outputs):
            nan, inf = (bool(v) for v in flags.tolist())
            if nan or (inf and on_error):
                signals.append(f"output of {name}")
                module = module or name
        if not signals:
            return held.nonfinite_locals(tb, self._roots.values()) if tb is not None else None
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
        for rec in self._inputs.values():  # the next forward is the next micro-batch's
            rec.taken = False
        if tensor.numel() == 1 and tensor.is_floating_point():
            # A loss scaled for its backward (`loss / accum_steps`, `scaler.scale(loss)`) is
            # recorded in the script's units: the loss series is the loss, not its copy.
            unscaled = self._amp.unscaled(tensor)
            if unscaled is None:
                unscaled = self.recorder.unscaled(tensor)
            self._loss = unscaled if unscaled is not None else tensor.detach()
            self._loss_seq += 1

    @fail_open("nanguard run's forward pre-hook")
    def _forward_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if forked() or self._quiet or replaying():
            return
        self._depth += 1
        if self._depth != 1:
            return
        self._roots[id(module)] = module
        if not torch.is_grad_enabled():
            return  # evaluation (`no_grad`): not a training batch
        params = self._has_params.get(module)
        if params is None:
            params = self._has_params[module] = next(module.parameters(), None) is not None
        if params:  # a model, not a loss module: recorded for the in-process replay
            self.recorder.saw_call(module, args)
        if self.preflight is not None and not self.preflight.done:
            self.preflight.saw_root_forward(module, args)
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

    @fail_open("nanguard run's forward hook")
    def _forward_post(self, module: nn.Module, args: tuple[Any, ...], *rest: Any) -> None:
        """A module's forward returned: `(module, args, kwargs, output)`. Registered with
        `always_call`, so that the depth count stays right when a forward raises (the script's
        own NaN check, a shape error): torch then calls it while the exception unwinds, as
        `(module, args, result)` without the keywords, and nothing but the count is taken."""
        if forked() or self._quiet or replaying():
            return
        self._depth = max(0, self._depth - 1)
        raised = len(rest) != 2
        if raised and not self._depth:
            self.recorder.saw_raise(module)
        if self._depth or raised:
            return
        kwargs, output = rest
        self.recorder.saw_output(module, kwargs, output)
        if kwargs and torch.is_grad_enabled() and self._has_params.get(module):
            self._keyword_batch(module, kwargs)
        if self.preflight is not None and not self.preflight.done and torch.is_grad_enabled():
            self.preflight.saw_root_output(module, output)
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

    def _keyword_batch(self, module: nn.Module, kwargs: dict[str, Any]) -> None:
        """A model called by keywords only (`model(input_ids=ids, labels=y)`, the transformers
        style; the pre-hook sees no positional tensor): its keyword tensors are the batch, as
        a dict, when no module produced them."""
        rec = self._inputs.setdefault(id(module), _Inputs())
        if rec.taken:
            return
        batch = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        if batch and not any(self._produced(t) for t in batch.values()):
            rec.data.append(batch)
            rec.taken = True

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
        w = self._by_opt.get(id(optimizer))
        if w is None or w.optimizer is not optimizer:
            w = self._attach(optimizer)
        w.starts.append(self._steps)
        self._steps += 1
        self._in_step = True
        clipped, self.clipped = self.clipped, None
        if clipped is not None and w.guard is not None and not w.guard.closed and any(
                id(p) in clipped[0] for g in optimizer.param_groups for p in g["params"]):
            w.guard.note_clip_norm(clipped[1])
        closure = _closure_of(args, kwargs)
        w.recipe = self.recorder.boundary(
            w.roots, closure=closure is not None,
            first_call=closure if _calls_closure_first(optimizer) else None)
        if w.guard is None or w.guard.closed:
            return None
        result = _run_closure_first(optimizer, args, kwargs)
        loss = self._loss if self._loss_seq > w.loss_seq else None
        w.loss_seq = self._loss_seq
        batches = self._take_batches(w)
        if isinstance(w.recipe, ClosureRecipe):
            w.recipe.batch = batches[0] if batches else None
        # Each micro-batch handed on in turn: the guard fingerprints them all, numbers their
        # samples across them and replays them one by one.
        w.guard.watch(loss=loss, batch=batches[0] if batches else None)
        for batch in batches[1:]:
            w.guard.watch_micro_batch(batch)
        return result

    @fail_open("nanguard run's optimizer step post-hook")
    def _optimizer_post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Global step post-hook: the update is done, the step's recipe is of no more use
        (its batch is let go)."""
        self._in_step = False
        w = self._by_opt.get(id(optimizer))
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
            w = self._by_opt.get(opt_id)
            if w is None:  # never stepped yet: skipped from its first iteration on
                skipped = True
                continue
            if len(w.starts) > w.updates_seen:
                w.updates_seen = len(w.starts)
                continue
            skipped = True
            if w.guard is not None and not w.guard.closed:
                batches = self._take_batches(w)
                loss = self._loss if self._loss_seq > w.loss_seq else None
                w.loss_seq = self._loss_seq
                w.guard.watch(loss=loss, batch=batches[0] if batches else None)
                for batch in batches[1:]:
                    w.guard.watch_micro_batch(batch)
        if skipped:
            self._inputs.clear()
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
        params = [p for r in self._roots.values() for p in r.parameters() if p.requires_grad]
        if not params:
            return None
        return self._attach(ManualStep(list(dict.fromkeys(params))))

    # ------------------------------------------------------------------ guards

    def _attach(self, optimizer: torch.optim.Optimizer) -> Watched:
        index = len(self.watched)
        folder = self.folder_for(index)
        roots = self._owners(optimizer)
        model = as_model(roots, optimizer)
        w = Watched(index=index, optimizer=optimizer, guard=None, model=model, folder=folder,
                    roots=roots)
        policy = self.policy
        if w.manual and policy in ("skip", "rollback", "heal"):
            # Discarding an update means taking the gradients away from the optimizer; a
            # hand-written update would then fail on `p.grad is None`. Watch only.
            w.note = (f"--policy {policy} cannot undo hand-written updates (no optimizer "
                      "steps in this script): watched with observe")
            policy = "observe"
        config = self.config
        if config.watch.activations and any(holds_compiled(r) for r in roots):
            # Hooks inside a compiled region would cost graph breaks: not hooked.
            config = dataclasses.replace(
                config, watch=dataclasses.replace(config.watch, activations=False))
        try:
            me = weakref.ref(self)

            def replay(batch: Any) -> torch.Tensor:
                d = me()
                if d is None:
                    raise NotReplayable("the run is over")
                return replay_recorded(w, batch)

            facts = self._facts()
            w.guard = Guard(model, optimizer, policy=policy, out=str(folder), config=config,
                            replay=replay, scaler=self._amp.scaler_for(optimizer), facts=facts)
            # The epilogue may re-run the failing step: findings wait for it (runner.py).
            w.guard.events.hold_findings()
            # A script's optimizers train coupled models (a GAN): they roll back together.
            w.guard.recovery.couple(self._coupling)
            # How to run it again (`nanguard replay`): sys.argv is the script's here.
            w.guard.store.write_meta(script=os.path.abspath(sys.argv[0]), argv=sys.argv[1:],
                                     cwd=os.getcwd(), optimizers=index + 1)
        except Exception as exc:  # noqa: BLE001 - the script must run on regardless
            w.error = f"{type(exc).__name__}: {exc}"
        before = replaced(self.watched, optimizer)
        if before is not None and w.guard is not None and before.guard is not None:
            # A new optimizer over the parameters of an earlier one (one every epoch): the
            # same training goes on, and its detectors keep their baselines.
            w.guard.take_baselines(before.guard)
        self.watched.append(w)
        self._by_opt[id(optimizer)] = w
        if len(self.watched) > 1:  # several parts: each one's live lines say which
            for part in self.watched:
                if part.guard is not None:
                    part.guard.events.name_part(part.name)
        return w

    def _facts(self) -> RunFacts:
        """The script's `RunFacts` (made at its first guard): fixes are phrased as `nanguard
        run` flags; the clip is the script's own, or 0 when its flag turned clipping off (it
        then never calls `clip_grad_norm_`); the preflight's verdict once it ran."""
        if self.facts is None:
            off = 0.0 if clip_from_argv(sys.argv[1:]) == 0 else None
            self.facts = RunFacts(
                entry="run", script_clip=self.script_clip if self.script_clip is not None
                else off)
        if self.preflight is not None and self.preflight.result is not None:
            self.facts.preflight = self.preflight.result
        return self.facts

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

    def _take_batches(self, w: Watched) -> list[tuple[torch.Tensor, ...] | dict[str, torch.Tensor]]:
        """The step's batches (its micro-batches, in order) of the first of `w`'s roots
        called with any."""
        for root in w.roots:
            rec = self._inputs.pop(id(root), None)
            if rec is not None:
                return rec.data or ([rec.other] if rec.other is not None else [])
        return []


def _closure_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The closure passed to `optimizer.step(closure)`, or None."""
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    return closure if callable(closure) else None


def _calls_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """A torch.optim optimizer (they all call their closure first thing in `step()`)."""
    return not isinstance(optimizer, ManualStep) and type(optimizer).__module__.startswith(
        "torch.optim")


def _run_closure_first(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`optimizer.step(closure)`: run the closure now (it makes the loss and the gradients the
    guard must check) and give the optimizer one whose first call returns that result, later
    calls (LBFGS line search) the real closure. Only for torch.optim's own optimizers, which
    all call the closure first thing; a custom optimizer might not call it at all."""
    if not _calls_closure_first(optimizer):
        return None
    in_args = len(args) > 1 and callable(args[1])
    closure = args[1] if in_args else kwargs.get("closure")
    if not callable(closure):
        return None
    with torch.enable_grad():
        first = closure()
    calls = [0]

    def replayed() -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return first
        return closure()

    if in_args:
        return (args[0], replayed, *args[2:]), kwargs
    return args, {**kwargs, "closure": replayed}

