"""Lightning: `NanguardCallback`, a thin adapter that drives a framework-free `Guard`.

    from nanguard.integrations.lightning import NanguardCallback

    trainer = lightning.Trainer(callbacks=[NanguardCallback(policy="skip", out="runs/x")])
    trainer.fit(model, loader)          # report.json and the summary when fit ends

Why these hooks. Lightning's automatic optimization calls `optimizer.step(closure)` and the
closure runs `training_step` and `backward`: a torch step pre-hook would run before the
gradients exist. So the Guard is built with `hook_optimizer=False` and the callback marks the
step boundary itself:

- `on_train_batch_start`: the batch (already on the device) -> `guard.watch(batch=...)`;
- `on_before_backward`: the loss (unscaled by the GradScaler's scale and multiplied back by
  `accumulate_grad_batches`, so it is the value `training_step` returned), kept on the device
  until the next optimizer step, whose guard gets it: under manual optimization each loss goes
  to the optimizer stepped after its `manual_backward`;
- `on_before_optimizer_step`: gradients final (after backward and AMP unscale, before Lightning's
  gradient clipping) -> `guard.before_update()`; `skip` removes the gradients here, so the
  clipping and the update that follow are no-ops;
- a step post-hook on the optimizer (right after the update) -> `guard.after_update()`; when the
  GradScaler skipped the update, `on_train_batch_end` does it instead;
- `on_train_batch_end`: the step's signals (`nanguard/loss`, `nanguard/grad_norm`, ...,
  `nanguard/nonfinite`, `nanguard/alarms`: alarms since the last batch) go to the trainer's
  loggers through `LightningModule.log_dict` (on_step, rank zero, NaN kept), so CSVLogger,
  TensorBoardLogger, WandbLogger show them beside the user's own metrics;
- `raise` stops training the Lightning way: the guard writes the report, the update of that
  step is discarded, `trainer.should_stop` is set and a line says why; `fit()` returns (no
  traceback) and `callback.report` holds the report;
- `on_fit_end` / `on_exception`: `guard.close()` (report.json, summary).

Several optimizers (a GAN under manual optimization): one Guard per optimizer, each watching the
smallest submodule that holds its parameters (the generator, the discriminator), recording into
`OUT/optimizer-N/`; the guards are coupled (under `rollback` they roll back together) and their
reports merged into `OUT/report.json`, whose `first_nonfinite.part` names the optimizer that saw
the earliest non-finite value and `run.parts` its module.

Under multi-process training (DDP) every rank runs its own guard in `OUT/rank-R/` and the guard's
decisions are agreed across ranks (one int32 all-reduce), so all ranks skip in the same step;
rank 0 merges the rank reports into `OUT/report.json`.

Nothing here is imported by `import nanguard`; importing this module imports Lightning
(`lightning`, else `pytorch_lightning`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard.detect.eval_metrics import eval_alarms
from nanguard.errors import NanguardError
from nanguard.guard import Guard
from nanguard.integrations import manifests
from nanguard.integrations.options import check_options, guard_setup, say_stopped
from nanguard.record import ending
from nanguard.record.events import Event
from nanguard.record.report import Report
from nanguard.step.state import RunFacts

try:  # the unified package first, the standalone one else
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.plugins.io import CheckpointIO
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import (  # type: ignore[assignment]
        Callback,
        LightningModule,
        Trainer,
    )
    from pytorch_lightning.plugins.io import CheckpointIO  # type: ignore[assignment]


class NanguardCallback(Callback):
    """Watches the LightningModule and each of its optimizers every optimizer step.

    Args:
        policy: `observe` (default), `raise`, `skip` or `rollback` (see `nanguard.Guard`).
        out: run folder; None: the Guard's default (`nanguard_runs/<time>-<pid>`). Required
            under multi-process training (ranks must agree on one folder); each rank then
            records into `out/rank-R/`.
        manifests: write a manifest (per-tensor sha256, `nanguard.audit.write_manifest`)
            beside every checkpoint the strategy saves (ModelCheckpoint's, `save_checkpoint`;
            removed with it), and verify the checkpoint `fit(ckpt_path=...)` resumes from:
            a difference is an ERROR line and a `checkpoint_mismatch` alarm at the first step.
            Costs one sha256 pass over each checkpoint saved (and resumed from, per process).
        **options: the Guard's other options: `activations`, `replay` (`replay(batch) ->
            loss`, e.g. `lambda b: module.training_step(b, 0)` when it only computes the
            loss; one optimizer only), `scheduler` and `scaler` (default: the Trainer's LR
            scheduler of each optimizer and its precision plugin's GradScaler), `config` (a
            `GuardConfig`).

    Raises:
        ValueError: at construction, on an unknown option, policy or config field; when fit
            starts, on a multi-process run without `out` or `replay` with several optimizers.

    After fit, `report` holds the Report (merged over optimizers, and on rank 0 under DDP over
    ranks), `guards` one Guard per optimizer (in the Trainer's order) and `guard` the first
    (None before fit starts and in the main process of `ddp_spawn`).
    """

    def __init__(self, policy: str | None = None, out: str | Path | None = None, *,
                 manifests: bool = False, **options: Any) -> None:
        check_options(policy, options)
        self.policy = policy
        self.out = out
        self.manifests = manifests
        self.options = options
        self.guards: list[Guard] = []
        self.report: Report | None = None
        self._by_opt: dict[int, Guard] = {}  # id(optimizer) -> its guard
        self._labels: list[str] = []  # each guard's part label and module, for the merge
        self._modules: list[str] = []
        self._folder: Path | None = None  # where the merged report goes (several guards)
        self._merged_summary = False
        self._state: dict[str, Any] | None = None  # loaded before the guards exist
        self._loss: torch.Tensor | None = None  # losses since the last optimizer step
        self._open: Guard | None = None  # before_update ran, after_update not yet
        self._order: list[Guard] = []  # guards in the order their optimizers first stepped
        self._handles: list[Any] = []
        self._world = 1
        self._rank = 0
        self._trainer: Trainer | None = None
        self._signals: dict[str, dict[str, float]] = {}  # part prefix -> its last step's
        self._alarms = 0  # alarms since the signals were last logged
        self.stopped: str | None = None
        """Why nanguard stopped training (the `raise` policy), None while it has not."""
        self._before_eval: dict[str, Any] = {}  # callback_metrics as validation began
        self._eval_seen: set[str] = set()  # metrics already said non-finite

    @property
    def guard(self) -> Guard | None:
        """The first optimizer's guard (the only one, usually)."""
        return self.guards[0] if self.guards else None

    # ------------------------------------------------------------------ building the guards

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs once fit starts, after the strategy set up the optimizers (and, under DDP, the
        process group), before a checkpoint's optimizer state is restored: builds one Guard
        per optimizer."""
        if self.guards:
            return
        optimizers = list(trainer.optimizers)
        if not optimizers:
            return
        if len(optimizers) > 1 and "replay" in self.options:
            raise ValueError("replay= computes one loss: it cannot serve several optimizers; "
                             "leave it out (each optimizer still gets its own guard)")
        self._world, self._rank = trainer.world_size, trainer.global_rank
        self._trainer = trainer
        if self.manifests:
            _with_manifests(trainer)
        opts = dict(self.options)
        out, cfg = guard_setup(self.out, opts.pop("config", None), self._world, self._rank,
                               self._state, "NanguardCallback")
        several = len(optimizers) > 1
        if several:
            self._folder = Path(out) if out is not None else Path("nanguard_runs") / (
                time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}")
            # one summary for the run: the merged one, printed by rank 0
            self._merged_summary = cfg.record.summary and self._rank == 0
            cfg.record = dataclasses.replace(cfg.record, summary=False)
        scaler = opts.pop("scaler", getattr(trainer.precision_plugin, "scaler", None))
        given = opts.pop("scheduler", None)
        for i, optimizer in enumerate(optimizers):
            name, module = (_owner(pl_module, optimizer, optimizers) if several
                            else ("", pl_module))
            scheduler = given if not several or getattr(given, "optimizer", None) is optimizer \
                else None
            if scheduler is None:
                scheduler = next((c.scheduler for c in trainer.lr_scheduler_configs
                                  if getattr(c.scheduler, "optimizer", None) is optimizer), None)
            folder = self._folder / f"optimizer-{i}" if self._folder is not None else out
            guard = Guard(module, optimizer, policy=self.policy, out=folder, config=cfg,
                          hook_optimizer=False, scheduler=scheduler, scaler=scaler,
                          facts=RunFacts(entry="lightning"), **opts)
            self.guards.append(guard)
            self._labels.append(f"optimizer-{i}")
            self._modules.append(name or type(module).__name__)
            self._by_opt[id(optimizer)] = guard
            self._handles.append(optimizer.register_step_post_hook(self._after_step))
            prefix = f"nanguard/optimizer-{i}/" if several else "nanguard/"
            if several:  # its live lines say which optimizer's they are
                guard.events.name_part(f"optimizer-{i}")
            guard.add_listener(self._keeper(prefix), only="step")
            guard.add_listener(self._count_alarm, only="alarm")
        if several:
            self.guards[0].couple(*self.guards[1:])
        if self._state is not None:
            self._load(self._state)
            self._state = None

    # ------------------------------------------------------------------ the step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Runs before `training_step`, with the batch already on the device: fingerprints
        (every optimizer's guard: each step of this batch trains on it)."""
        for guard in self.guards:
            if not guard.closed:
                guard.watch(batch=batch)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule,
                           loss: torch.Tensor) -> None:
        """Runs right before `backward` with the loss Lightning back-propagates: scaled by the
        GradScaler and divided by `accumulate_grad_batches`; both undone on the device. Kept
        for the next optimizer step (a non-finite one is never hidden by a later one)."""
        if not self.guards:
            return
        value = loss.detach().reshape(-1)[:1].double()
        scale = getattr(getattr(trainer.precision_plugin, "scaler", None), "_scale", None)
        if isinstance(scale, torch.Tensor):
            value = value / scale.to(value.device)
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            value = value * trainer.accumulate_grad_batches
        if self._loss is not None and self._loss.device == value.device:
            value = torch.where(torch.isfinite(self._loss), value, self._loss)
        self._loss = value

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Runs after the closure (training_step + backward) and the AMP unscale, before
        gradient clipping and the update: that optimizer's guard reads, detects and decides
        here."""
        guard = self._by_opt.get(id(optimizer))
        if guard is None or guard.closed:
            return
        if self._loss is not None:
            guard.watch(loss=self._loss)
            self._loss = None
        self._open = guard
        if guard not in self._order:
            self._order.append(guard)
        try:
            guard.before_update()
        except NanguardError as exc:  # `raise`: this update must not happen either
            self._open = None
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad = None  # the optimizer leaves a parameter without .grad untouched
            self._stop(exc)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook of each optimizer: right after the update."""
        self._finish_step()

    def _finish_step(self) -> None:
        guard, self._open = self._open, None
        if guard is not None:
            try:
                guard.after_update()
            except NanguardError as exc:
                self._stop(exc)

    def _stop(self, exc: NanguardError) -> None:
        """The `raise` policy stopped training (the guard closed and wrote its report): stop
        the Trainer the way Lightning stops (`should_stop`: fit ends after this batch)."""
        self.stopped, self.report = str(exc), exc.report
        if self._trainer is not None:
            self._trainer.should_stop = True
        say_stopped(exc, "trainer.should_stop")

    def _keeper(self, prefix: str) -> Callable[[Event], None]:
        """A step listener keeping the part's last recorded step's signals."""
        def keep(event: Event) -> None:
            self._signals[prefix] = event.data
        return keep

    def _count_alarm(self, event: Event) -> None:
        self._alarms += 1

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Runs after the optimizer step and the per-step LR scheduler step. Closes the step
        when the optimizer did not run (the GradScaler skipped an overflow step), then logs
        the last recorded step's signals through the trainer's loggers (rank zero, on_step;
        Lightning applies `log_every_n_steps`)."""
        self._finish_step()
        if not self._signals or not trainer.loggers:  # no logger: nothing to log to
            return
        metrics = {f"{prefix}{k}": v for prefix, signals in self._signals.items()
                   for k, v in signals.items()}
        metrics["nanguard/alarms"] = float(self._alarms)
        self._signals, self._alarms = {}, 0
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, prog_bar=False, logger=True,
                           rank_zero_only=True, batch_size=1)

    # ------------------------------------------------------------------ evaluation

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs before a validation loop: which metric objects exist already (a metric
        validation logs is a new object at its end)."""
        self._before_eval = dict(trainer.callback_metrics)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs when a validation loop ends (not the sanity check): each metric it logged that
        is NaN/Inf becomes an `eval_nonfinite` alarm of the first guard, once per metric
        (`detect.eval_metrics`); training is untouched."""
        guard = self.guard
        if trainer.sanity_checking or guard is None or guard.closed:
            return
        metrics = trainer.callback_metrics
        fresh = [k for k, v in metrics.items() if self._before_eval.get(k) is not v]
        for alarm in eval_alarms(metrics, guard.step, self._eval_seen, keys=fresh):
            guard.record_alarm(alarm)

    # ------------------------------------------------------------------ the end

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs when fit returns normally: report.json and the summary."""
        self._close("ok", None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        """Runs when fit ends by an exception (KeyboardInterrupt: `interrupted`)."""
        self._close(*ending.classify(exception))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Runs last in every stage; closes guards left open (never raises)."""
        if stage == "fit" and any(not g.closed for g in self.guards):
            self._close("ok", None)

    def _close(self, ended: str, error: str | None) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if not self.guards:
            return
        already = all(g.closed for g in self.guards)
        reports = [g.close(ended, error) for g in self.guards]
        self.report = reports[0]
        if already:
            return
        from nanguard.record.merge import collect_rank_reports, merge_reports

        if self._folder is not None:  # several optimizers: one report over them
            for report, guard in zip(reports, self.guards, strict=True):
                report.run["folder"] = str(guard.folder)
            # At the same step and phase the optimizer that steps first in a batch saw it
            # first (a GAN's generator step, then the discriminator's on its output).
            timed = sorted(zip(self._labels, reports, self.guards, strict=True),
                           key=lambda p: self._rank_in_time(p[2]))
            merged = merge_reports([(label, r) for label, r, _ in timed],
                                   {"folder": str(self._folder), "entry": "lightning"})
            for label, module in zip(self._labels, self._modules, strict=True):
                merged.run["parts"][label]["module"] = module
            merged.write(self._folder)
            self.report = merged
        if self._world > 1 and self._rank == 0 and self.out is not None:
            parts, missing = collect_rank_reports(Path(self.out), self._world)
            merged = merge_reports(parts, {"folder": str(self.out), "world_size": self._world,
                                           "missing_ranks": missing, "entry": "lightning"})
            merged.write(Path(self.out))
            self.report = merged
        if self._merged_summary:
            self._print_merged(self.report)

    def _rank_in_time(self, guard: Guard) -> int:
        return self._order.index(guard) if guard in self._order else len(self._order)

    def _print_merged(self, report: Report) -> None:
        from nanguard.show.summary import print_summary

        print_summary(report, parts_history={label: g.history for label, g in
                                             zip(self._labels, self.guards, strict=True)})

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: each guard's state (plain data: the checkpoint
        loads with `weights_only=True`) and the run folder."""
        if not self.guards or any(g.error is not None for g in self.guards):
            return {}
        folder = self._folder or self.guards[0].folder
        state: dict[str, Any] = {
            "folder": str(folder) if folder is not None and self._world <= 1 else None}
        if len(self.guards) == 1:
            state["guard"] = self.guards[0].state_dict()
        else:
            state["guards"] = [g.state_dict() for g in self.guards]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by a Trainer resuming from a checkpoint (`fit(ckpt_path=...)`), before or
        after `on_fit_start` depending on the strategy: the guards resume where they left
        off, recording into the same folder (unless `out` says otherwise)."""
        if not state_dict:
            return
        if self.guards:
            self._load(state_dict)
        else:
            self._state = dict(state_dict)

    def _load(self, state: dict[str, Any]) -> None:
        states = state["guards"] if "guards" in state else [state["guard"]]
        if len(states) != len(self.guards):
            raise ValueError(f"the checkpoint holds {len(states)} guard state(s) for "
                             f"{len(self.guards)} optimizer(s): it comes from another setup")
        for guard, s in zip(self.guards, states, strict=True):
            guard.load_state_dict(s)


def _owner(root: nn.Module, optimizer: torch.optim.Optimizer,
           optimizers: list[torch.optim.Optimizer]) -> tuple[str, nn.Module]:
    """The network `optimizer` trains: the outermost submodule of `root` that holds all of its
    parameters and none of the other optimizers' (`self.generator`, not the `Sequential`
    inside it), with its name; `root` itself (name "") when no child qualifies."""
    wanted = _param_ids(optimizer)
    others = set().union(*(_param_ids(o) for o in optimizers if o is not optimizer))
    name, module = "", root
    while others & {id(p) for p in module.parameters()}:
        inner = next(((n, c) for n, c in module.named_children()
                      if wanted <= {id(p) for p in c.parameters()}), None)
        if inner is None:
            return "", root
        name = f"{name}.{inner[0]}" if name else inner[0]
        module = inner[1]
    return name, module


def _param_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    return {id(p) for g in optimizer.param_groups for p in g["params"]}


class _ManifestIO(CheckpointIO):
    """The strategy's checkpoint IO, and a manifest written after every save (removed with
    the checkpoint when ModelCheckpoint rotates it out). Saving happens where the strategy
    saves (global rank 0 for a single-file checkpoint)."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        manifests.write(path)

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        loaded: dict[str, Any] = self.inner.load_checkpoint(path, map_location=map_location,
                                                            weights_only=weights_only)
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)
        from nanguard.audit.manifest import MANIFEST_SUFFIX

        with contextlib.suppress(OSError):
            os.remove(os.fspath(path) + MANIFEST_SUFFIX)

    def teardown(self) -> None:
        self.inner.teardown()


def _with_manifests(trainer: Trainer) -> None:
    """`manifests=True`: verify the checkpoint `fit(ckpt_path=...)` resumes from (before its
    training state is restored, on every rank: each rank's guard gets the alarm) and write a
    manifest after every checkpoint the strategy saves."""
    ckpt = getattr(trainer, "ckpt_path", None)
    if ckpt and os.path.exists(os.fspath(ckpt)):
        manifests.verify(ckpt, f"Trainer.fit(ckpt_path={os.fspath(ckpt)!r})")
    strategy = trainer.strategy
    if not isinstance(strategy.checkpoint_io, _ManifestIO):
        strategy.checkpoint_io = _ManifestIO(strategy.checkpoint_io)
