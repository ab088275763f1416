"""Lightning: `NanguardCallback`, a thin adapter that drives a framework-free `Guard`.

    from nanguard.integrations.lightning import NanguardCallback

    trainer = lightning.Trainer(callbacks=[NanguardCallback(policy="skip", out="runs/x")])
    trainer.fit(model, loader)          # report.json and the summary when fit ends

Why these hooks. Lightning's automatic optimization calls `optimizer.step(closure)` and the
closure runs `training_step` and `backward`: a torch step pre-hook would run before the
gradients exist. So the Guard is built with `hook_optimizer=False` and the callback marks the
step boundary itself:

- `on_train_batch_start`: the batch (already on the device) -> `guard.watch(batch=...)`;
- `on_before_backward`: the loss -> `guard.watch(loss=...)` (unscaled by the GradScaler's scale
  and multiplied back by `accumulate_grad_batches`, so it is the value `training_step` returned);
- `on_before_optimizer_step`: gradients final (after backward and AMP unscale, before Lightning's
  gradient clipping) -> `guard.before_update()`; `skip` removes the gradients here, so the
  clipping and the update that follow are no-ops;
- a step post-hook on the optimizer (right after the update) -> `guard.after_update()`; when the
  GradScaler skipped the update, `on_train_batch_end` does it instead;
- `on_fit_end` / `on_exception`: `guard.close()` (report.json, summary).

Under multi-process training (DDP) every rank runs its own guard in `OUT/rank-R/` and the guard's
decisions are agreed across ranks (one int32 all-reduce), so all ranks skip in the same step;
rank 0 merges the rank reports into `OUT/report.json`.

Nothing here is imported by `import nanguard`; importing this module imports Lightning
(`lightning`, else `pytorch_lightning`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from nanguard.guard import Guard
from nanguard.integrations.options import check_options, guard_setup
from nanguard.record import ending
from nanguard.record.report import Report

try:  # the unified package first, the standalone one else
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import (  # type: ignore[assignment]
        Callback,
        LightningModule,
        Trainer,
    )

class NanguardCallback(Callback):
    """Watches the LightningModule and its optimizer every optimizer step.

    Args:
        policy: `observe` (default), `raise`, `skip` or `rollback` (see `nanguard.Guard`).
        out: run folder; None: the Guard's default (`nanguard_runs/<time>-<pid>`). Required
            under multi-process training (ranks must agree on one folder); each rank then
            records into `out/rank-R/`.
        **options: the Guard's other options: `activations`, `replay` (`replay(batch) ->
            loss`, e.g. `lambda b: module.training_step(b, 0)` when it only computes the
            loss), `scheduler` and `scaler` (default: the Trainer's first LR scheduler and its
            precision plugin's GradScaler), `config` (a `GuardConfig`).

    Raises:
        ValueError: at construction, on an unknown option, policy or config field; when fit
            starts, on several optimizers (one Guard watches one optimizer) or on a
            multi-process run without `out`.

    After fit, `report` holds the Report (on rank 0 under DDP: the merged one) and `guard`
    the Guard (None before fit starts and in the main process of `ddp_spawn`).
    """

    def __init__(self, policy: str | None = None, out: str | Path | None = None,
                 **options: Any) -> None:
        check_options(policy, options)
        self.policy = policy
        self.out = out
        self.options = options
        self.guard: Guard | None = None
        self.report: Report | None = None
        self._state: dict[str, Any] | None = None  # loaded before the guard exists
        self._in_step = False  # before_update ran, after_update not yet
        self._handle: Any = None
        self._world = 1
        self._rank = 0

    # ------------------------------------------------------------------ building the guard

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs once fit starts, after the strategy set up the optimizers (and, under DDP, the
        process group), before a checkpoint's optimizer state is restored: builds the Guard."""
        if self.guard is not None:
            return
        optimizers = list(trainer.optimizers)
        if len(optimizers) != 1:
            raise ValueError(
                f"NanguardCallback watches exactly one optimizer, the Trainer has "
                f"{len(optimizers)}; use nanguard.Guard(module, opt, hook_optimizer=False) per "
                "optimizer with before_update()/after_update() in manual optimization")
        optimizer = optimizers[0]
        self._world, self._rank = trainer.world_size, trainer.global_rank
        opts = dict(self.options)
        out, cfg = guard_setup(self.out, opts.pop("config", None), self._world, self._rank,
                               self._state, "NanguardCallback")
        if "scheduler" not in opts and trainer.lr_scheduler_configs:
            opts["scheduler"] = trainer.lr_scheduler_configs[0].scheduler
        if "scaler" not in opts:
            opts["scaler"] = getattr(trainer.precision_plugin, "scaler", None)
        guard = Guard(pl_module, optimizer, policy=self.policy, out=out, config=cfg,
                      hook_optimizer=False, **opts)
        guard.run_entry = "lightning"
        self.guard = guard
        if self._state is not None:
            guard.load_state_dict(self._state["guard"])
            self._state = None
        self._handle = optimizer.register_step_post_hook(self._after_step)

    # ------------------------------------------------------------------ the step

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Runs before `training_step`, with the batch already on the device: fingerprints."""
        if self.guard is not None:
            self.guard.watch(batch=batch)

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule,
                           loss: torch.Tensor) -> None:
        """Runs right before `backward` with the loss Lightning back-propagates: scaled by the
        GradScaler and divided by `accumulate_grad_batches`; both undone on the device."""
        if self.guard is None:
            return
        value = loss.detach()
        scale = getattr(getattr(trainer.precision_plugin, "scaler", None), "_scale", None)
        if isinstance(scale, torch.Tensor):
            value = value / scale.to(value.device)
        if pl_module.automatic_optimization and trainer.accumulate_grad_batches > 1:
            value = value * trainer.accumulate_grad_batches
        self.guard.watch(loss=value)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Runs after the closure (training_step + backward) and the AMP unscale, before
        gradient clipping and the update: the guard reads, detects and decides here."""
        if self.guard is None or self.guard.closed:
            return
        self._in_step = True
        self.guard.before_update()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Step post-hook of the optimizer: right after the update."""
        if self._in_step and self.guard is not None:
            self._in_step = False
            self.guard.after_update()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        """Runs after the optimizer step and the per-step LR scheduler step. Closes the step
        when the optimizer did not run (the GradScaler skipped an overflow step)."""
        if self._in_step and self.guard is not None:
            self._in_step = False
            self.guard.after_update()

    # ------------------------------------------------------------------ the end

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Runs when fit returns normally: report.json and the summary."""
        self._close("ok", None)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        """Runs when fit ends by an exception (KeyboardInterrupt: `interrupted`)."""
        self._close(*ending.classify(exception))

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Runs last in every stage; closes a guard left open (never raises)."""
        if stage == "fit" and self.guard is not None and not self.guard.closed:
            self._close("ok", None)

    def _close(self, ended: str, error: str | None) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        guard = self.guard
        if guard is None:
            return
        already = guard.closed
        report = guard.close(ended, error)
        self.report = report
        if already or self._world <= 1 or self._rank != 0 or self.out is None:
            return
        from nanguard.integrations.merge import collect_rank_reports, merge_reports

        parts, missing = collect_rank_reports(Path(self.out), self._world)
        merged = merge_reports(parts, {"folder": str(self.out), "world_size": self._world,
                                       "missing_ranks": missing, "entry": "lightning"})
        merged.write(Path(self.out))
        self.report = merged

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: the guard's state and its run folder."""
        if self.guard is None or self.guard.error is not None:
            return {}
        folder = self.guard.folder
        return {"guard": self.guard.state_dict(),
                "folder": str(folder) if folder is not None and self._world <= 1 else None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by a Trainer resuming from a checkpoint (`fit(ckpt_path=...)`), before or
        after `on_fit_start` depending on the strategy: the guard resumes where it left off,
        recording into the same folder (unless `out` says otherwise)."""
        if not state_dict:
            return
        if self.guard is not None:
            self.guard.load_state_dict(state_dict["guard"])
        else:
            self._state = dict(state_dict)
