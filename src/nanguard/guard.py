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

This module is the Guard's public face and lifecycle; it orchestrates. What runs inside the
optimizer's step is `step_path.StepPath`; how a guard is built, `wiring`; its state across a
resume, `guard_state`. What the run saw lives in its run log (`record.runlog`); recovery and
the policy stage return effects (`recover.effects`) that `apply` carries out; the report is
built by `record.closing`.
"""

from __future__ import annotations

import atexit
import sys
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanguard import guard_state, wiring
from nanguard.config import GuardConfig
from nanguard.detect import Alarm
from nanguard.detect.detectors import Detector
from nanguard.policy import make_policy
from nanguard.record import ending
from nanguard.record.closing import announce_finding, run_report
from nanguard.record.events import Events, Listener
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.record.runlog import RunLog
from nanguard.record.standdown import note_internal_error
from nanguard.record.store import open_store
from nanguard.recover.link import WeakLink
from nanguard.recover.recovery import Recovery
from nanguard.runtime import distributed
from nanguard.step_path import StepPath
from nanguard.watch import replicas, saturation
from nanguard.watch.replicas import ReplicaCheck
from nanguard.watch.saturation import SaturationProbe
from nanguard.watch.stats import StepStats
from nanguard.watch.step import StepWatch


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

    # Set in `__init__` (the step path's own state: `StepPath`; how: `nanguard.wiring`).
    detectors: list[Detector]  # pre-step ones first (`detect.default_detectors`)
    steps: StepWatch
    """The watch stage: each step's packets, read back as `StepStats`."""
    events: Events
    """Every alarm, action and finding as it happens; `add_listener` subscribes."""
    log: RunLog
    """Alarms, actions, the first non-finite finding, spikes and the steps before it."""
    report: Report | None  # the report `close()` wrote; None before
    run_entry: str
    """How the user runs nanguard: `api` (this class) or `run` (`nanguard run`, set by the
    runner); the diagnosis words its fixes for that entry point."""
    script_clip: float | None
    """`nanguard run`: the `max_norm` of the script's own `clip_grad_norm_` (0 when off);
    the diagnosis weighs its fixes by it."""
    script_argv: list[str]
    """The command line the training script was started with (`sys.argv[1:]` when the guard
    is made: the script's own under `nanguard run`, torchrun or `python train.py ...`); a fix
    names the flag that set the value it changes (`--lr 0.05` -> `--lr 0.005`)."""
    preflight: dict[str, Any] | None
    """`nanguard run --preflight`: its verdict, for the diagnosis."""
    error: dict[str, Any] | None
    """Set when nanguard stood down after an error in its own hooks (see `stand_down`)."""
    saturation: SaturationProbe | None  # armed one step in `saturation_every`; None: off
    replicas: ReplicaCheck | None  # replica agreement under DDP (issue 28); None: off
    _hooked: bool  # hooks `optimizer.step()` (False: an adapter calls before/after_update)
    _exit: distributed.LockstepExit | None  # owed to the other ranks after standing down
    _handles: list[RemovableHandle]
    _atexit: Callable[[], None]
    _closed: bool
    _ended: tuple[str, str | None]  # how the run ended (`close`; `ok` until then)

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
        cfg = wiring.settle_config(model, optimizer, config, policy=policy, out=out,
                                   activations=activations)
        self.config, self.replay, self.model, self.optimizer = cfg, replay, model, optimizer
        # Before any hook is registered: an unwritable folder must leave the model untouched.
        self.store = self._open_store(cfg.record.out, cfg.record.if_exists)
        self.run_entry, self.script_clip, self.preflight, self.error = "api", None, None, None
        self.script_argv = list(sys.argv[1:])
        self.detectors = wiring.watch_stage(self)
        wiring.step_state(self)
        self._closed, self._ended, self.report = False, ("ok", None), None
        self.events, self.log = wiring.record_stage(
            self.store, cfg, on_alarm=on_alarm, on_action=on_action, on_finding=on_finding)
        self.recovery = Recovery(WeakLink(self), scheduler=scheduler, scaler=scaler)
        self.policy = make_policy(cfg.policy, cfg.acting_on, cfg.recover.max_consecutive_skips)
        wiring.write_start(self)
        # Their hooks before the guard's own: the saturation probe disarms before the guard's
        # pre-hook (and any replay) runs; the replica check (DDP) is a post-hook of its own.
        self.saturation = saturation.attach(self, cfg.detect.saturation_every)
        self.replicas = replicas.attach(self, cfg.detect.replica_every,
                                        rides=cfg.policy != "observe")
        self._hooked, self._exit = hook_optimizer, None
        self._handles = wiring.hooks(self, hook_optimizer)
        self._atexit = wiring.close_at_exit(self)
        ending.acquire()

    # ------------------------------------------------------------------ public face

    def add_listener(self, listener: Listener, *, only: str | None = None) -> None:
        """Call `listener(event)` with every later `Event` (or, with `only`, those of one type:
        `alarm`, `action`, `finding`, `episode_end`, or `step`: each recorded step's signals,
        which only `only="step"` delivers), as it happens; errors inside it are contained (see
        `on_alarm`). `close` (also only with `only`): once, when `close()` has written the
        report (its dict in `data`). Exporters and framework adapters subscribe this way."""
        self.events.subscribe(listener, only)

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

    def take_baselines(self, other: Guard) -> None:
        """Start this guard's detectors from `other`'s baselines (each series detector's
        window of healthy values and typical level), when this guard's optimizer replaces
        `other`'s over the same parameters: a script that builds a new optimizer every epoch
        keeps its spike and divergence statistics instead of a fresh warm-up each time.
        Episodes, cooldowns and runs of growth start afresh. Call it before this guard's
        first step; detectors of other classes or orders are left alone."""
        if self.step or len(other.detectors) != len(self.detectors):
            return
        for mine, theirs in zip(self.detectors, other.detectors, strict=True):
            take = getattr(mine, "take_baselines", None)  # the series detectors'
            if take is not None and type(mine) is type(theirs):
                take(theirs)

    def note_clip_norm(self, total_norm: torch.Tensor | float) -> None:
        """Give the guard the total gradient norm your own clipping measured before it clipped
        (what `torch.nn.utils.clip_grad_norm_` returns), for the step in progress: call it
        after clipping, before `optimizer.step()`. The guard measures the gradients at the
        step, after your clipping; the spike measures score the grad norm before it, as OLMo
        does (run.db `steps.clip_norm`). A tensor stays on its device until the step's read
        (no host sync). `nanguard run` and the Lightning callback call this themselves."""
        if self.error is not None:
            return
        try:
            t = (total_norm.detach() if isinstance(total_norm, torch.Tensor)
                 else torch.tensor(float(total_norm)))
            self._clip_norm = t.reshape(())
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "note_clip_norm")

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
        self._ended = ending.settle(ended, error)
        self._closed = True
        self.detach()
        if (objective := getattr(self, "_objective", None)) is not None:
            objective.close()  # no longer a peer of other guards (`detect.objective`)
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
        report = self._publish(close_store=True)
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
        self._exit = distributed.LockstepExit.after_stand_down(
            exc, self.optimizer, self._agree_device, hooked=self._hooked,
            observe=self.config.policy == "observe", cross_rank=self._cross_rank,
            in_hook=self._in_hook, agreed=self._agreed)

    def refine(self, finding: dict[str, Any]) -> Report:
        """After `close()`: take a refined first-non-finite finding (e.g. from a re-run with the
        op checker armed), diagnose again and rewrite report.json. Returns the new report."""
        self.log.set_finding(finding, write=False)
        return self._publish()

    def run_log(self) -> dict[str, Any]:
        """What this run has seen, as plain data: the first non-finite finding, alarms, actions,
        spikes, the steps that led into the failure (`history`, step records), the failing
        step's batch flags, the optimizer's settings and how nanguard was started. `explain`
        builds its evidence from it alone (`explain.context.evidence_from_log`); `state_dict`
        carries it, so a resumed guard explains with the history from before the resume.

        Set by other parts, read here with a default: `run_entry`, `script_clip` (the
        `max_norm` of the script's own clipping, 0 when off), `script_argv` and `preflight`."""
        return self.log.plain(
            optimizer=self.optimizer, params=self.params, detectors=self.detectors,
            lead_window=self.config.detect.lead_window,
            facts={"script_clip": self.script_clip, "entry": getattr(self, "run_entry", "api"),
                   "preflight": self.preflight, "script_argv": self.script_argv})

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume watching where this guard left off, the run log
        included (`run_log()`: history and failing step for a diagnosis after the resume)."""
        self._flush()
        return guard_state.gather(self, self.detectors, self.run_log())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (e.g. when resuming from a checkpoint).

        The rollback snapshot is not part of the state (it is a full copy of the model): after
        a resume, the last good state is the state the guard was created with."""
        guard_state.restore(self, self.detectors, state)

    # ------------------------------------------------------------------ recording

    def record_action(self, step: int, action: str, detail: str) -> None:
        """Record what was done at `step` (report.json `actions`; written to run.db at once)."""
        self.log.add_action(step, action, detail)

    def record_alarm(self, alarm: Alarm) -> None:
        """Record an alarm raised outside the detectors (the saturation probe, replica
        agreement): report.json `alarms`, run.db at once, an `alarm` event."""
        self.log.add_alarm(alarm)

    def _publish(self, close_store: bool = False) -> Report:
        """Diagnose and build the report from the run log, write report.json (then close the
        run store, at close: the report reads run.db first) and announce a failed run's
        finding. Returns the report, kept in `report`."""
        report = run_report(
            self.log, self.run_log(), optimizer=self.optimizer, model=self.model,
            policy=self.config.policy, entry=self.run_entry, closed=self._closed,
            steps=self.step, ended=self._ended, last=self._last_stats, losses=self._losses,
            recovery_cost=self.recovery.cost(), folder=self.folder,
            lead_window=self.config.detect.lead_window,
            error=self.error, listener_errors=self.events.errors)
        if self.folder is not None:
            report.write(self.folder)
        if close_store:
            self.store.close()
        self.report = report
        announce_finding(self.events, report)
        return report

    # The store a new guard records to; `run.replay.record_nothing` swaps it.
    _open_store = staticmethod(open_store)
