"""The Guard: watches a model and its optimizer every step, warns, records, and applies a policy.

A plain loop needs two extra lines::

    guard = nanguard.Guard(model, optimizer)          # hooks the optimizer's step
    for x, y in loader:
        loss = loss_fn(model(x), y)
        guard.watch(loss=loss, batch=(x, y))          # optional: loss and fingerprints
        loss.backward()
        optimizer.step()                              # the guard runs inside this call
        optimizer.zero_grad()
    guard.close()                                     # or `with Guard(...) as guard:`

The step boundary is the optimizer's step: a pre-hook runs after backward (and any clipping)
and before the update; a post-hook runs right after it. Observing costs a few fused device
reductions and, in the default `observe` policy, one host read per step (or per
`read_every` steps). Policies that act before the update (`raise`, `skip`) read the
pre-step statistics in the pre-hook, so they make two small reads per step.

This module is the Guard's public face and lifecycle (build, watch, close, state); what runs
inside the optimizer's step is `step_path.StepPath`. What the run saw lives in its run log
(`record.runlog`); recovery and the policy stage return effects (`recover.effects`) that
`apply` carries out; pinpointing inside a step is `pinpoint.live`; the report is built by
`record.closing`.
"""

from __future__ import annotations

import atexit
import dataclasses
import time
import weakref
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard._version import __version__
from nanguard.config import GuardConfig
from nanguard.detect import Alarm, default_detectors
from nanguard.detect.detectors import Detector
from nanguard.detect.gate import QuietGate
from nanguard.integrations import distributed
from nanguard.policy import make_policy
from nanguard.record import ending
from nanguard.record.closing import recovery_summary, run_report
from nanguard.record.events import EVENT_TYPES, Event, Events, Listener
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.record.runlog import RunLog
from nanguard.record.standdown import note_internal_error
from nanguard.record.store import open_store
from nanguard.recover.link import WeakLink
from nanguard.recover.policy import Recovery
from nanguard.recover.verdict import LossWatch
from nanguard.show import live
from nanguard.step_path import StepPath
from nanguard.watch import replicas, rng, saturation
from nanguard.watch.activations import ActivationProbe, dtype_max
from nanguard.watch.batch import BatchProbe
from nanguard.watch.stats import StepProbe, StepStats, watched_buffers
from nanguard.watch.step import Pending, StepWatch


class Guard(StepPath):
    """Watches `model` trained by `optimizer`; see the module docstring for the loop.

    Args:
        model: the model being trained (any `nn.Module`).
        optimizer: its optimizer; the guard hooks its `step()`.
        policy: `observe` (default, changes nothing), `raise`, `skip`, `rollback` or `heal`;
            overrides `config`. `heal` (for loss spikes of LMs at an aggressive LR) skips a
            non-finite update like `skip` and, in the pre-hook before each update, scales the
            gradients down to their rolling typical norm when the grad norm jumps (the step
            before a loss spike), then cuts the weight decay or the LR when such jumps recur
            (`HealConfig`, `nanguard.recover.heal`); every action is in report.json `actions`
            and its cost in `run.recovery.heal`.
        out: run folder; None picks `nanguard_runs/<time>`, "" records nothing.
        activations: also watch per-module activation abs-max and headroom.
        replay: `replay(batch) -> loss`, your forward and loss. When given, the first step whose
            loss, gradients or activations go non-finite is replayed in process, before the
            update, from the same parameters, RNG states and batch (the one handed to `watch`)
            under the op-level checker; report.json's `first_nonfinite` then names the op,
            module, source line and samples where the value was produced. Until then the guard
            reads its statistics before the update too (one extra small read per step).
        scheduler: the LR scheduler, if any: `rollback` restores its state with the rest.
        scaler: the `torch.amp.GradScaler`, if any: overflow steps it skips are counted (never
            an alarm), a collapsing scale is an alarm, and `rollback` restores its state.
        config: full settings; the keyword arguments above override its fields.
        hook_optimizer: hook `optimizer.step()` (default). False: a framework adapter marks the
            step boundary itself with `before_update()` / `after_update()` (Lightning runs the
            training step as an optimizer closure: a step pre-hook would run before the
            gradients exist).
        on_alarm: called with an `Event` for every alarm, as it is recorded (its `notable`
            says whether it opened or escalated an episode: what the live log shows). On the
            CPU and under acting policies that is inside the `optimizer.step()` of the step
            that raised it; under `observe` on a GPU, one step later. An exception inside it
            is logged once and the callback dropped; training goes on.
        on_action: the same for every action (skip, rollback, raise, give_up, ...).
        on_finding: the same for the first non-finite finding: when it is pinpointed in
            process, and at `close()` with its top cause on a failed run.

    Raises:
        ValueError: on arguments that cannot work (unknown policy, not a module, an unwritable
            run folder), with a one-line message that says what to do.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        policy: str | None = None,
        out: str | Path | None = None,
        activations: bool | None = None,
        replay: Callable[[Any], torch.Tensor] | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        config: GuardConfig | None = None,
        hook_optimizer: bool = True,
        on_alarm: Listener | None = None,
        on_action: Listener | None = None,
        on_finding: Listener | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"model must be a torch.nn.Module, got {type(model).__name__}; "
                "pass the model you train"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass the optimizer whose step() trains the model"
            )
        cfg = dataclasses.replace(config) if config else GuardConfig()
        if policy is not None:
            cfg.policy = policy
        if activations is not None:
            cfg.watch = dataclasses.replace(cfg.watch, activations=activations)
        if out is not None:
            cfg.record = dataclasses.replace(cfg.record, out=str(out))
        cfg.validate()
        self.config = cfg
        self.replay = replay
        self.model = model
        self.optimizer = optimizer
        # Before any hook is registered: an unwritable folder must leave the model untouched.
        self.store = self._open_store(cfg.record.out, cfg.record.if_exists)
        self.run_entry = "api"
        """How the user runs nanguard: `api` (this class) or `run` (`nanguard run`, set by the
        runner); the diagnosis words its fixes for that entry point."""
        self.script_clip: float | None = None
        """`nanguard run`: the `max_norm` of the script's own `clip_grad_norm_` (0 when off);
        the diagnosis weighs its fixes by it."""
        self.preflight: dict[str, Any] | None = None
        """`nanguard run --preflight`: its verdict, for the diagnosis."""
        self.error: dict[str, Any] | None = None
        """Set when nanguard stood down after an error in its own hooks (see `stand_down`)."""

        self.params: list[torch.Tensor] = []
        self.param_names: list[str] = []
        self._param_order: list[int] = []  # module order of each parameter (locate's tiebreak)
        self.buffer_names, buffers = watched_buffers(model)
        self.probe = StepProbe(self.params, optimizer, buffers)
        self._sync_params()
        self.act_probe = (ActivationProbe(model, attention=cfg.watch.attention)
                          if cfg.watch.activations else None)
        self.batch_probe = BatchProbe()
        self.steps = StepWatch(self.probe, self.batch_probe, self.act_probe, cfg.watch,
                               on_loaded=self._loaded_finding)
        """The watch stage: each step's packets, read back as `StepStats`."""
        act_limit = None
        if cfg.watch.activations:
            dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
            act_limit = min((dtype_max(d) for d in dtypes), default=None)
        self.detectors: list[Detector] = default_detectors(cfg.detect, act_limit)
        pre = [d for d in self.detectors if d.phase == "pre"]
        post = [d for d in self.detectors if d.phase == "post"]
        self._by_phase = {"pre": pre, "post": post, "both": pre + post}
        self._gate = QuietGate(self.detectors)
        """Steps no detector could alarm on: their state updates only (`detect.gate`)."""
        self._rerun_every = cfg.detect.rerun_every

        self.step = 0
        self._last_stats: StepStats | None = None
        self._grad_baseline: dict[int, float] = {}  # per-parameter EMA of healthy grad norms
        self._loss: torch.Tensor | None = None
        self._pending: list[Pending] = []
        self._current: Pending | None = None
        self._stashed_grads: list[torch.Tensor | None] | None = None
        self._step_rng = rng.capture()
        self._closed = False
        self._check_loaded = True  # state loaded before the first update: checked once
        self._load_site: str | None = None
        self._watch_calls = 0  # watch(loss=...) calls since the last optimizer step
        self._skips_in_row = 0  # consecutive updates the `skip` policy discarded
        self._losses = LossWatch()  # the loss level before any trouble, and since
        self.report: Report | None = None
        self.events = Events(quiet_steps=max(cfg.detect.lead_window, 10))
        self.events.summary_follows = cfg.record.summary
        """Every alarm, action and finding as it happens; `add_listener` subscribes."""
        self.log = RunLog(self.store, self.events)
        """Alarms, actions, the first non-finite finding, spikes and the steps before it."""
        live.ensure_handler()
        self.events.add(live.log_event)
        for fn, kind in ((on_alarm, "alarm"), (on_action, "action"), (on_finding, "finding")):
            if fn is not None:
                self.add_listener(fn, only=kind)
        self.recovery = Recovery(WeakLink(self), scheduler=scheduler, scaler=scaler)
        self.policy = make_policy(cfg.policy, cfg.acting_on, cfg.recover.max_consecutive_skips)

        self.store.write_meta(
            version=__version__, policy=cfg.policy, model=type(model).__name__,
            optimizer=type(optimizer).__name__, started=time.time(),
        )
        self._write_params()
        self.store.write_rng(0, rng.dumps(self._step_rng))
        # Its hooks first: it disarms before this guard's pre-hook (and any replay) runs.
        self.saturation = saturation.attach(self, cfg.detect.saturation_every)
        # Issue 28: replica agreement under DDP, its own post-hook (watch/replicas.py); None: off.
        self.replicas = replicas.attach(self, cfg.detect.replica_every,
                                        rides=cfg.policy != "observe")
        self._hooked = hook_optimizer
        self._in_hook: str | None = None  # `pre` / `post` while a step hook runs
        self._agreed = False  # that hook took part in its cross-rank agreement
        self._rerun_rank: int | None = None  # the agreement asked for a cross-rank re-run
        self._cross_rank = self._crosses_ranks()
        self._exit: distributed.LockstepExit | None = None  # owed after standing down
        self._handles = [
            *([optimizer.register_step_pre_hook(self._pre_hook),
               optimizer.register_step_post_hook(self._post_hook)] if hook_optimizer else []),
            model.register_load_state_dict_post_hook(self._on_load),
            optimizer.register_load_state_dict_post_hook(self._on_load),
        ]
        ref = weakref.ref(self)
        self._atexit = lambda: (g := ref()) is not None and g.close()
        atexit.register(self._atexit)
        ending.acquire()

    # ------------------------------------------------------------------ public face

    def add_listener(self, listener: Listener, *, only: str | None = None) -> None:
        """Call `listener(event)` with every later `Event` (or, with `only`, those of one type:
        `alarm`, `action`, `finding`, `episode_end`, or `step`: each recorded step's signals,
        which only `only="step"` delivers), as it happens; errors inside it are contained (see
        `on_alarm`). `close` (also only with `only`): once, when `close()` has written the
        report (its dict in `data`). Exporters and framework adapters subscribe this way."""
        if not callable(listener):
            raise ValueError(f"a listener must be callable, got {type(listener).__name__}")
        if only not in (None, *EVENT_TYPES):
            raise ValueError(f"unknown event type {only!r}; use one of {', '.join(EVENT_TYPES)}")
        if only in (None, "step", "close"):
            self.events.add(listener, steps=only == "step", close=only == "close")
            return

        def typed(event: Event) -> None:
            if event.type == only:
                listener(event)

        typed.__qualname__ = getattr(listener, "__qualname__", type(listener).__name__)
        self.events.add(typed)

    @property
    def folder(self) -> Path | None:
        """The run folder, or None when recording is off."""
        return getattr(self.store, "folder", None)

    @property
    def host_reads(self) -> int:
        """Host reads of step statistics made so far (one per step under the defaults)."""
        return self.steps.host_reads

    def watch(self, *, loss: torch.Tensor | float | None = None, batch: Any = None) -> None:
        """Hand the guard this step's loss and/or batch. Call any time before `optimizer.step()`.

        The loss is detached and kept on its device (no host read here). The batch (a tensor, or
        a tuple / list / dict of tensors sharing the leading batch dimension) is fingerprinted
        per sample on the device and kept by reference for replay.

        Raises:
            ValueError: the guard is closed (create a new one for another run).
        """
        if self._closed:
            raise ValueError("this Guard is closed: create a new Guard for another run")
        if self.error is not None:
            return
        try:
            self._watch(loss, batch)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "watch")

    def watch_micro_batch(self, batch: Any) -> None:
        """Hand the guard another micro-batch of the step being watched (gradient
        accumulation), after `watch()` gave the first: kept beside the others, its samples
        numbered after theirs. Also under a GradScaler, where a second `watch(batch=...)`
        before the step means the scaler skipped a step."""
        if self.error is not None:
            return
        try:
            self.batch_probe.observe(batch, accumulate=True)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "watch")

    def couple(self, *others: Guard) -> None:
        """Under `rollback`: roll back together with `others`, guards of other models trained
        on each other's outputs (a GAN's generator and discriminator). Guards of the same model
        are coupled already; `nanguard run` couples all the guards of a script."""
        group = self.model
        for g in (self, *others):
            g.recovery.couple(group)

    @property
    def closed(self) -> bool:
        """True once `close()` ran (the report is written; the guard cannot be used again)."""
        return self._closed

    @property
    def alarms(self) -> list[Alarm]:
        """Every alarm so far, in the order recorded (the run log's list)."""
        return self.log.alarms

    @property
    def actions(self) -> list[dict[str, Any]]:
        """Every action so far (`step`, `action`, `detail`), as report.json's `actions`."""
        return self.log.actions

    @property
    def spikes(self) -> list[dict[str, Any]]:
        """Where each spike sits (step, layers, samples), as report.json's `spikes`."""
        return self.log.spikes

    @property
    def history(self) -> deque[StepStats]:
        """The last recorded steps, up to one past the first non-finite one (the run log's)."""
        return self.log.history

    @property
    def failing_stats(self) -> StepStats | None:
        """The statistics of the step where the first non-finite value showed."""
        return self.log.failing

    @property
    def first_nonfinite(self) -> dict[str, Any] | None:
        """report.json's `first_nonfinite` so far (a copy: set it, or `refine` after close,
        to change it), or None."""
        return self.log.finding_dict()

    @first_nonfinite.setter
    def first_nonfinite(self, found: dict[str, Any] | None) -> None:
        # Not written to run.db nor announced: the caller decides (`nanguard run` does).
        self.log.finding = None if found is None else Finding.from_dict(found)

    def before_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call when the gradients are final
        for the update (after backward and AMP unscale; before or after clipping, as the
        framework allows) and before the optimizer updates. Runs
        what the step pre-hook runs: reads, detects and, for `skip`, removes the gradients so
        the coming update is a no-op (`after_update` gives them back)."""
        if self._closed:
            raise ValueError("this Guard is closed: create a new Guard for another run")
        if self.error is None:
            self._pre_hook(self.optimizer, (), {})
        elif self._exit is not None:
            self._exit.pay("pre")

    def after_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call right after the optimizer's
        update (or where it would have been, when the step was skipped)."""
        if self.error is None and not self._closed:
            self._post_hook(self.optimizer, (), {})
        elif self._exit is not None:
            self._exit.pay("post")

    def __enter__(self) -> Guard:
        if self._closed:
            raise ValueError("this Guard is closed: create a new Guard for another run")
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if not self._closed:
            self.close(*ending.classify(exc))

    def close(self, ended: str | None = None, error: str | None = None) -> Report:
        """Remove every hook, read what is pending, write report.json, print the summary.

        Safe to call more than once; also runs at interpreter exit if forgotten (then how the
        process is ending — an uncaught exception, SIGTERM — is taken into account).

        Args:
            ended: how the training ended: `ok`, `error` (it raised or exited non-zero),
                `interrupted` (SIGINT / SIGTERM) or `stopped` (the `raise` policy); None: as
                far as nanguard saw (`ok` unless an uncaught exception or SIGTERM is on its
                way). A `with` block passes it.
            error: a one-line description of that error, kept in report.json's `run.ended`.
        """
        if self._closed:
            assert self.report is not None
            return self.report
        if ended is None:
            ended, error = ending.seen()
        if ended not in ending.ENDINGS:
            raise ValueError(f"unknown ending {ended!r}; use one of: {', '.join(ending.ENDINGS)}")
        self._closed = True
        self._ended = (ended, error)
        self.detach()
        atexit.unregister(self._atexit)
        ending.release()
        if self.error is None:
            try:
                self._flush()
                self._check_leftover()
                self.store.flush()  # a writer failure in the last batch: degraded, not lost
            except Exception as exc:  # noqa: BLE001 - still write the report below
                self.stand_down(exc, "close")
        self.events.tick(self.step, final=True)
        report = self._build_report()
        if self.folder is not None:
            report.write(self.folder)
        self.store.close()
        self.report = report
        self._say_finding(report)
        # After the finding: a streaming exporter writes it, then finishes its tracker run.
        if self.events.close_listeners:
            self.events.close(self.step, report.to_dict())
        if self.config.record.summary:
            from nanguard.show.summary import print_summary

            print_summary(report, self.history)
        return report

    def detach(self) -> None:
        """Remove every hook of this guard, closing nothing (a forked child that goes on with
        the script leaves the store and the run folder to its parent)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.saturation:
            self.saturation.remove()
        if self.act_probe:
            self.act_probe.close()

    def stand_down(self, exc: BaseException, where: str) -> None:
        """An error inside nanguard's own code: record it (traceback in the run folder and in
        run.db), say so once, remove every hook and leave training exactly as it would run
        without nanguard. The report's status becomes `degraded` (unless a non-finite value
        was already seen: then the run had failed before nanguard stood down)."""
        if self.error is not None:
            return
        if self._stashed_grads is not None:  # a skip in flight: give the gradients back
            for p, g in zip(self.params, self._stashed_grads, strict=True):
                p.grad = g
            self._stashed_grads = None
        self._current = None
        self._pending = []
        self.detach()
        self.error = note_internal_error(exc, where, self.step, self.folder, self.store)
        observe = self.config.policy == "observe"
        if ((not observe or self._cross_rank) and distributed.active()
                and not isinstance(exc, distributed.PeerStoodDown)):
            # The other ranks agree every decision with this one: take part in the next
            # agreement, saying so, and every rank stands down in it (nobody waits). Under
            # `observe` (agreeing for the cross-rank re-run) there is one, before the update.
            self._exit = distributed.LockstepExit(self.optimizer, self._agree_device,
                                                  hooked=self._hooked)
            if self._in_hook is not None and not self._agreed and not (
                    observe and self._in_hook == "post"):
                self._exit.pay_now()  # the others are in this hook's agreement now
            else:
                self._exit.owe("post" if self._in_hook == "pre" and not observe else "pre")

    def refine(self, finding: dict[str, Any]) -> Report:
        """After `close()`: take a refined first-non-finite finding (e.g. from a re-run with the
        op checker armed), diagnose again and rewrite report.json. Returns the new report."""
        self.log.set_finding(finding, write=False)
        report = self._build_report()
        if self.folder is not None:
            report.write(self.folder)
        self.report = report
        self._say_finding(report)
        return report

    def _say_finding(self, report: Report) -> None:
        """The finding event of a failed run, with its top cause (at close, after a refine)."""
        if report.status == "failed" and report.first_nonfinite is not None:
            self.events.finding(report.first_nonfinite,
                                report.diagnosis[0] if report.diagnosis else None,
                                notable=not self.events.summary_follows)

    def run_log(self) -> dict[str, Any]:
        """What this run has seen, as plain data: the first non-finite finding, alarms, actions,
        spikes, the steps that led into the failure (`history`, step records), the failing
        step's batch flags, the optimizer's settings and how nanguard was started. `explain`
        builds its evidence from it alone (`explain.context.evidence_from_log`); `state_dict`
        carries it, so a resumed guard explains with the history from before the resume.

        Set by other parts, read here with a default: `run_entry`, `script_clip` (the
        `max_norm` of the script's own clipping, 0 when off) and `preflight`."""
        return self.log.plain(
            optimizer=self.optimizer, params=self.params, detectors=self.detectors,
            lead_window=self.config.detect.lead_window,
            facts={"script_clip": self.script_clip, "entry": getattr(self, "run_entry", "api"),
                   "preflight": self.preflight})

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume watching where this guard left off, the run log
        included (`run_log()`: history and failing step for a diagnosis after the resume)."""
        self._flush()
        log = self.run_log()
        return {
            "step": self.step,
            "detectors": [d.state_dict() for d in self.detectors],
            **self.log.state_dict(),
            "recovery": self.recovery.state_dict(),
            "grad_baseline": {str(i): v for i, v in self._grad_baseline.items()},
            "log": {"history": log["history"][-64:], "failing": log["failing"]},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (e.g. when resuming from a checkpoint).

        The rollback snapshot is not part of the state (it is a full copy of the model): after
        a resume, the last good state is the state the guard was created with."""
        if len(state["detectors"]) != len(self.detectors):
            raise ValueError("state_dict comes from a guard with a different set of detectors")
        self.step = int(state["step"])
        for d, s in zip(self.detectors, state["detectors"], strict=True):
            d.load_state_dict(s)
        self.log.load_state_dict(state)
        if "recovery" in state:
            self.recovery.load_state_dict(state["recovery"])
        self._grad_baseline = {int(i): float(v) for i, v in state.get("grad_baseline", {}).items()}

    # ------------------------------------------------------------------ recording

    def record_action(self, step: int, action: str, detail: str) -> None:
        """Record what was done at `step` (report.json `actions`; written to run.db at once)."""
        self.log.add_action(step, action, detail)

    def record_alarm(self, alarm: Alarm) -> None:
        """Record an alarm raised outside the detectors (the saturation probe, replica
        agreement): report.json `alarms`, run.db at once, an `alarm` event."""
        self.log.add_alarm(alarm)

    def _build_report(self) -> Report:
        ended, message = getattr(self, "_ended", ("ok", None))
        return run_report(
            self.log, self.run_log(), optimizer=self.optimizer, steps=self.step, ended=ended,
            message=message, last=self._last_stats,
            recovery=recovery_summary(self.log, self._losses, self.recovery.cost()),
            folder=self.folder, lead_window=self.config.detect.lead_window,
            run={"folder": str(self.folder) if self.folder else None,
                 "policy": self.config.policy, "model": type(self.model).__name__,
                 "optimizer": type(self.optimizer).__name__, "version": __version__,
                 "closed": self._closed, "entry": self.run_entry},
            error=self.error, listener_errors=self.events.errors)

    # The store a new guard records to; `integrations.replay.record_nothing` swaps it.
    _open_store = staticmethod(open_store)
