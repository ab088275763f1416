"""transformers: `NanguardCallback` for `Trainer`, a thin adapter over a framework-free `Guard`.

    from nanguard.integrations.transformers import NanguardCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[NanguardCallback(policy="skip", out="runs/x")])
    trainer.train()                     # report.json and the summary when training ends

What the Trainer hides and how the callback gets it:

- The loss. `logging_nan_inf_filter` (on by default) replaces a NaN/Inf loss by the running
  average in the logs, and no callback event receives the loss. The callback reads it on the
  device from the model's own output (`output.loss`, a forward hook on the model while it is in
  training mode), with the batch (the forward's tensor arguments, for per-sample fingerprints).
  A custom `compute_loss` or `compute_loss_func` computes the loss outside the model: use
  `NanguardTrainer` (or `NanguardTrainerMixin`), which takes the loss from `compute_loss`.
- The step boundary. The Guard is built with `hook_optimizer=False`: `on_pre_optimizer_step`
  (gradients final: after backward, accumulation and the Trainer's clipping, before
  `optimizer.step()`) -> `guard.before_update()`; `on_optimizer_step` (right after the update)
  -> `guard.after_update()`.
- Skipping. The Trainer has no skip flag; `skip` removes the gradients in `on_pre_optimizer_step`,
  so the coming `optimizer.step()` changes nothing (no update, no Adam step count); the LR
  scheduler steps as usual, and the guard (given the Trainer's scheduler) takes that step
  back before the next update (`recover.skips`); the gradients are given back before
  `zero_grad`.
- The logs. `on_log` adds the last recorded step's signals (`nanguard/loss`, `nanguard/grad_norm`,
  ..., NaN kept where `logging_nan_inf_filter` hides the loss's) and `nanguard/alarms` (alarms
  since the last log) to the logs and to that entry of `state.log_history`. Reporting
  integrations (`report_to`) that run before this callback miss them: `NanguardTrainer` puts its
  callback first, so W&B, TensorBoard or MLflow get them too.
- `raise` stops training the Trainer's way: the guard writes the report, the step's update is
  discarded, `control.should_training_stop` is set and a line says why; `train()` returns (no
  traceback) and `callback.report` holds the report.
- The end. `on_train_end` closes the guard. The Trainer has no exception event: a `train()`
  that raises leaves the guard to its at-exit close, or use `NanguardTrainer`, which closes it
  with `ended="error"` (or `interrupted`) at once.

- Checkpoints. `on_save` writes the guard's state as JSON (`nanguard_state.json`) into the
  `checkpoint-N/` folder the Trainer just wrote; `train(resume_from_checkpoint=...)` loads it
  when training starts again: step numbering, detector history, alarms, actions and the run
  folder carry on. With `manifests=True` each `checkpoint-N/` also gets a manifest of
  per-tensor hashes, and a resume verifies the folder against it (`integrations/manifests.py`).

Clipping happens before the callback sees the gradients: with `max_grad_norm > 0` a NaN in one
gradient turns every gradient NaN through the clip coefficient, so `first_nonfinite.param` may
name any parameter; the step, phase, rows and diagnosis are unaffected.

Under multi-process training every rank records into `OUT/rank-R/` and the guard's decisions are
agreed across ranks; the main process merges the rank reports into `OUT/report.json`.

Importing this module imports transformers; `import nanguard` does not.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from nanguard.detect.eval_metrics import eval_alarms
from nanguard.errors import NanguardError
from nanguard.guard import Guard
from nanguard.integrations import manifests
from nanguard.integrations.options import check_options, guard_setup, say_stopped
from nanguard.record import ending
from nanguard.record.events import Event
from nanguard.record.report import Report
from nanguard.runtime.hooks import ModuleHook
from nanguard.step.state import RunFacts


class NanguardCallback(TrainerCallback):
    """Watches the Trainer's model and optimizer every optimizer step.

    Args:
        policy: `observe` (default), `raise`, `skip` or `rollback` (see `nanguard.Guard`).
        out: run folder; None: the Guard's default. Required under multi-process training
            (each rank records into `out/rank-R/`).
        manifests: write a manifest (per-tensor sha256, `nanguard.audit.write_manifest`)
            into every `checkpoint-N/` the Trainer saves, and verify the checkpoint a
            `train(resume_from_checkpoint=...)` resumed from against its manifest: a
            difference is an ERROR line and a `checkpoint_mismatch` alarm at the first step.
            Costs one sha256 pass over each checkpoint saved (and resumed from, per process).
        **options: the Guard's other options: `activations`, `replay` (`replay(batch) ->
            loss`, e.g. `lambda b: model(**b).loss`), `scheduler` (default: the Trainer's),
            `scaler`, `config` (a `GuardConfig`).

    Raises:
        ValueError: at construction, on an unknown option, policy or config field; when
            training starts, on a multi-process run without `out`.

    After training, `report` holds the Report (the merged one on the main process under
    multi-process training) and `guard` the Guard.
    """

    def __init__(self, policy: str | None = None, out: str | Path | None = None, *,
                 manifests: bool = False, **options: Any) -> None:
        check_options(policy, options)
        self.policy = policy
        self.out = out
        self.manifests = manifests
        self.options = options
        self.guard: Guard | None = None
        self._eval_seen: set[str] = set()  # evaluation metrics already said non-finite
        self.report: Report | None = None
        self.loss_from_trainer = False
        """Set by `NanguardTrainerMixin`: the loss comes from `compute_loss`, not the model."""
        self.resume_from: str | None = None
        """The checkpoint folder `train(resume_from_checkpoint=...)` resumes from, when the
        callback cannot find it itself (`NanguardTrainer` sets it)."""
        self._hook: Any = None
        self._in_step = False
        self._signals: dict[str, float] = {}  # the last recorded step's
        self._alarms = 0  # alarms since the last on_log
        self.stopped: str | None = None
        """Why nanguard stopped training (the `raise` policy), None while it has not."""
        self._world = 1
        self._rank = 0

    # ------------------------------------------------------------------ building the guard

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Runs once `train()` has built the optimizer and scheduler (and loaded a checkpoint
        to resume from), before the first batch: builds the Guard."""
        if self.guard is not None and not self.guard.closed:
            return
        if model is None or optimizer is None:
            raise ValueError("NanguardCallback needs the Trainer's model and optimizer")
        raw = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        self._world, self._rank = int(args.world_size), int(args.process_index)
        resumed = self._resumed_state(args, state)
        if self.manifests and int(state.global_step) > 0:
            # Loaded by now: what the model and optimizer hold came from this folder.
            folder = self._resumed_folder(args, state)
            manifests.verify(folder, f"Trainer.train(resume_from_checkpoint={folder!r})")
        opts = dict(self.options)
        out, cfg = guard_setup(self.out, opts.pop("config", None), self._world, self._rank,
                               resumed, "NanguardCallback")
        if "scheduler" not in opts and lr_scheduler is not None:
            opts["scheduler"] = lr_scheduler
        guard = Guard(model, raw, policy=self.policy, out=out, config=cfg,
                      hook_optimizer=False, facts=RunFacts(entry="transformers"), **opts)
        self.guard = guard
        guard.add_listener(self._keep_signals, only="step")
        guard.add_listener(self._count_alarm, only="alarm")
        if resumed is not None:
            guard.load_state_dict(resumed["guard"])
        self._hook = model.register_forward_hook(ModuleHook(self._on_forward), with_kwargs=True)

    # ------------------------------------------------------------------ the step

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any) -> None:
        """Forward hook on the model: in training mode, its loss and its tensor inputs."""
        guard = self.guard
        if guard is None or not module.training or not torch.is_grad_enabled():
            return
        batch = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        batch.update({f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)})
        loss = None
        if not self.loss_from_trainer:
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss",
                                                                                  None)
            if not isinstance(loss, torch.Tensor):
                loss = None
        guard.watch(loss=loss, batch=batch or None)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Runs after the last micro-batch's backward and the Trainer's gradient clipping,
        before `optimizer.step()`: the guard reads, detects and decides here."""
        if self.guard is None or self.guard.closed:
            return
        self._in_step = True
        try:
            self.guard.before_update()
        except NanguardError as exc:  # `raise`: this update must not happen either
            self._in_step = False
            for p in self.guard.params:
                p.grad = None  # the optimizer leaves a parameter without .grad untouched
            self._stop(exc, control)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Runs right after `optimizer.step()`, before the scheduler step and `zero_grad`."""
        if self._in_step and self.guard is not None:
            self._in_step = False
            try:
                self.guard.after_update()
            except NanguardError as exc:
                self._stop(exc, control)

    def _stop(self, exc: NanguardError, control: Any) -> None:
        """The `raise` policy stopped training (the guard closed and wrote its report): the
        Trainer ends after this step (`should_training_stop`), as its own callbacks stop it."""
        self.stopped, self.report = str(exc), exc.report
        control.should_training_stop = True
        say_stopped(exc, "control.should_training_stop")

    def _keep_signals(self, event: Event) -> None:
        self._signals = event.data

    def _count_alarm(self, event: Event) -> None:
        self._alarms += 1

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        """Runs each time the Trainer logs (every `logging_steps`), after `state.log_history`
        took the entry: the last recorded step's signals and the alarm count join both."""
        if logs is None or not self._signals or "loss" not in logs and "grad_norm" not in logs:
            return  # not a training log (an evaluation's, the final summary)
        extra = {f"nanguard/{k}": v for k, v in self._signals.items()}
        extra["nanguard/alarms"] = float(self._alarms)
        self._alarms = 0
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_evaluate(self, args: Any, state: Any, control: Any,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Runs when `Trainer.evaluate` has its metrics: each NaN/Inf one (`eval_loss`, ...)
        becomes an `eval_nonfinite` alarm, once per metric (`detect.eval_metrics`); training
        is untouched."""
        if not metrics or self.guard is None or self.guard.closed:
            return
        for alarm in eval_alarms(metrics, self.guard.step, self._eval_seen):
            self.guard.record_alarm(alarm)

    # ------------------------------------------------------------------ checkpoints

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Runs right after the Trainer wrote `checkpoint-N/` (after the step's update): the
        guard's state goes next to it, as JSON (`nanguard_state.json`, one per rank under
        multi-process training), so `train(resume_from_checkpoint=...)` resumes the guard."""
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():  # a hyperparameter search's trial folder: not ours to guess
            return
        if self.manifests:
            if self._world > 1 and torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's files written before the hashing
            if self._rank == 0:
                manifests.write(folder)
        guard = self.guard
        if guard is None or guard.closed or guard.error is not None:
            return
        run = guard.folder
        payload = {"format": 1, "global_step": int(state.global_step),
                   "guard": guard.state_dict(),
                   "folder": str(run) if run is not None and self._world <= 1 else None}
        path = folder / _state_file(self._world, self._rank)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload))
        tmp.replace(path)  # never a half-written state next to a good checkpoint

    def _resumed_state(self, args: Any, state: Any) -> dict[str, Any] | None:
        """At `on_train_begin`: the state saved in the checkpoint the Trainer resumed from, or
        None for a fresh run. A resumed Trainer has `global_step > 0` already here."""
        if int(state.global_step) <= 0:
            return None
        path = Path(self._resumed_folder(args, state)) / _state_file(self._world, self._rank)
        if not path.is_file():
            warnings.warn(f"nanguard: the Trainer resumed at step {state.global_step} but "
                          f"{path} does not exist; the guard starts afresh (its steps counted "
                          "from 0)", stacklevel=2)
            return None
        saved: dict[str, Any] = json.loads(path.read_text())
        return saved

    def _resumed_folder(self, args: Any, state: Any) -> str:
        """The checkpoint folder a resumed Trainer loaded (at `on_train_begin`)."""
        return self.resume_from or _resume_argument() or str(
            Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")

    # ------------------------------------------------------------------ the end

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Runs when `train()` finishes normally: report.json and the summary."""
        self.close("ok")

    def close(self, ended: str = "ok", error: str | None = None) -> Report | None:
        """Close the guard (idempotent); the main process merges rank reports under DDP."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        guard = self.guard
        if guard is None:
            return None
        already = guard.closed
        self.report = guard.close(ended, error)
        if not already and self._world > 1 and self._rank == 0 and self.out is not None:
            from nanguard.record.merge import collect_rank_reports, merge_reports

            parts, missing = collect_rank_reports(Path(self.out), self._world)
            merged = merge_reports(parts, {"folder": str(self.out), "world_size": self._world,
                                           "missing_ranks": missing, "entry": "transformers"})
            merged.write(Path(self.out))
            self.report = merged
        return self.report


class NanguardTrainerMixin:
    """Mix into a `Trainer` subclass (`class T(NanguardTrainerMixin, Trainer)`) to take the loss
    from `compute_loss` (custom losses, `compute_loss_func`, a subclass's own `compute_loss`:
    the most derived one is wrapped on the instance) and to close the guard at once
    when `train()` raises. Adds a `NanguardCallback` built from `nanguard=` options when the
    Trainer has none: `NanguardTrainer(model=..., args=..., nanguard={"policy": "skip"})`."""

    def __init__(self, *args: Any, nanguard: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        handler = self.callback_handler  # type: ignore[attr-defined]
        found = [cb for cb in handler.callbacks if isinstance(cb, NanguardCallback)]
        if not found:
            found = [NanguardCallback(**(nanguard or {}))]
            handler.add_callback(found[0])
        elif nanguard:
            raise ValueError("pass nanguard= or a NanguardCallback in callbacks=, not both")
        self.nanguard_callback: NanguardCallback = found[0]
        self.nanguard_callback.loss_from_trainer = True
        # First among the callbacks: the reporting integrations' on_log see its signals.
        handler.callbacks.remove(found[0])
        handler.callbacks.insert(0, found[0])
        self._wrap_compute_loss()

    def _wrap_compute_loss(self) -> None:
        """Wrap the most derived `compute_loss` (a subclass's own override included) on the
        instance: its loss goes to the guard on the device, before any GA scaling."""
        inner: Any = getattr(self, "compute_loss")  # noqa: B009 - the most derived one
        cb = self.nanguard_callback

        def compute_loss(model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            result = inner(model, inputs, *args, **kwargs)
            return_outputs = kwargs.get("return_outputs", args[0] if args else False)
            guard = cb.guard
            if guard is not None and model.training and torch.is_grad_enabled():
                loss = result[0] if return_outputs else result
                if isinstance(loss, torch.Tensor):
                    guard.watch(loss=loss)
            return result

        setattr(self, "compute_loss", compute_loss)  # noqa: B010 - on the instance

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`, closing the guard with how it ended when it raises."""
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:
            resume = get_last_checkpoint(self.args.output_dir)  # type: ignore[attr-defined]
        self.nanguard_callback.resume_from = str(resume) if resume not in (None, False) else None
        try:
            return super().train(*args, **kwargs)  # type: ignore[misc]
        except BaseException as exc:
            self.nanguard_callback.close(*ending.classify(exc))
            raise


class NanguardTrainer(NanguardTrainerMixin, Trainer):
    """`Trainer` with `NanguardTrainerMixin`: `NanguardTrainer(..., nanguard={...})`."""


def _state_file(world: int, rank: int) -> str:
    return "nanguard_state.json" if world <= 1 else f"nanguard_state-rank{rank}.json"


def _resume_argument() -> str | None:
    """The `resume_from_checkpoint` folder of the `Trainer.train` call running now.

    No callback event receives it; the Trainer's own frames hold it (a public argument name of
    `train()`, resolved from `True` to the last checkpoint before the loop starts)."""
    frame = sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get("resume_from_checkpoint")
        if isinstance(value, str) and isinstance(frame.f_locals.get("self"), Trainer):
            return value
        frame = frame.f_back  # type: ignore[assignment]
    return None
