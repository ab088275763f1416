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

How it fits together: the Guard is the public face and the run's lifecycle (build, watch,
close, resume). It holds one `step.pipeline.StepPipeline`: its optimizer step pre-hook runs
after backward and clipping, before the update; its post-hook right after. They measure the
step, judge it (detectors, the first non-finite finding, the policy) and record it. The parts
are made once by `step.build`; what carries between steps is `step.state.StepState`; the run
log is the one writer of the record, from which `close()` builds the report.
"""

from __future__ import annotations

import atexit
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard import guard_state
from nanguard.config import GuardConfig
from nanguard.detect import Alarm
from nanguard.record import ending
from nanguard.record.closing import announce_finding, run_report
from nanguard.record.events import Listener
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.recover.effects import Effect
from nanguard.step.build import settle_config
from nanguard.step.pipeline import StepPipeline
from nanguard.step.state import RunFacts
from nanguard.watch.stats import StepStats

_CLOSED = "this Guard is closed: create a new Guard for another run"


class Guard:
    """Watches `model` trained by `optimizer`; see the module docstring for the loop.

    Args:
        model: the model being trained (any `nn.Module`).
        optimizer: its optimizer; the guard hooks its `step()`.
        policy: `observe` (default, changes nothing), `raise`, `skip`, `rollback` or `heal`
            (skips a non-finite update, scales down a jumping gradient and cuts the weight
            decay or LR when jumps recur: `HealConfig`); overrides `config`.
        out: run folder; None picks `nanguard_runs/<time>`, "" records nothing.
        activations: also watch per-module activation abs-max and headroom.
        replay: `replay(batch) -> loss`, your forward and loss: the first step whose values
            go non-finite is replayed in process, before the update, under the op checker
            (`first_nonfinite` then names the op, module, line and samples).
        scheduler: the LR scheduler, if any: `rollback` restores its state with the rest.
        scaler: the `torch.amp.GradScaler`, if any: its skipped steps are counted (never an
            alarm), a collapsing scale is an alarm, `rollback` restores its state.
        config: full settings; the keyword arguments above override its fields.
        hook_optimizer: hook `optimizer.step()` (default). False: a framework adapter marks
            the step boundary with `before_update()` / `after_update()`.
        on_alarm: called with an `Event` for every alarm as it is recorded (inside the
            `optimizer.step()` that raised it; under `observe` on a GPU, one step later); an
            exception inside it is logged once and the callback dropped.
        on_action: the same for every action; on_finding: for the first non-finite finding.
        facts: how nanguard was started (`step.state.RunFacts`: entry point, the script's
            clip and argv, the preflight's verdict); adapters and `nanguard run` pass theirs.

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
        facts: RunFacts | None = None,
    ) -> None:
        cfg = settle_config(model, optimizer, config, policy=policy, out=out,
                            activations=activations)
        self.config, self.model, self.optimizer, self.replay = cfg, model, optimizer, replay
        self.facts = facts if facts is not None else RunFacts()
        """How nanguard was started: the diagnosis words its fixes by it."""
        self.report: Report | None = None  # what `close()` wrote
        self._closed = False
        self._ended: tuple[str, str | None] = ("ok", None)  # how the run ended (`close`)
        pipe = self._pipe = StepPipeline(
            cfg, model, optimizer, replay=replay, scheduler=scheduler, scaler=scaler,
            on_alarm=on_alarm, on_action=on_action, on_finding=on_finding, stop=self.close)
        parts = pipe.parts
        self.events = parts.events
        """Every alarm, action and finding as it happens; `add_listener` subscribes."""
        self.log = parts.log
        """Alarms, actions, the first non-finite finding, spikes and the steps before it."""
        self.steps = parts.steps
        """The watch stage: each step's packets, read back as `StepStats`."""
        self.store, self.detectors = parts.store, parts.detectors
        self.recovery, self.policy = parts.recovery, parts.policy
        self.probe, self.act_probe, self.batch_probe = (parts.probe, parts.act_probe,
                                                        parts.batch_probe)
        self.saturation, self.replicas = parts.saturation, parts.replicas
        pipe.attach(hook_optimizer)  # after the saturation probe's and replica check's hooks
        self._atexit = ending.close_at_exit(self)
        ending.acquire()

    # ------------------------------------------------------------------ what it has seen

    @property
    def step(self) -> int:
        """Optimizer steps completed."""
        return self._pipe.state.step

    @property
    def params(self) -> list[torch.Tensor]:
        """The watched parameters, as the optimizer holds them."""
        return self._pipe.state.params

    @property
    def param_names(self) -> list[str]:
        """Their names in the model."""
        return self._pipe.state.param_names

    @property
    def error(self) -> dict[str, Any] | None:
        """Set when nanguard stood down after an error in its own hooks (`stand_down`)."""
        return self._pipe.error

    @property
    def closed(self) -> bool:
        """True once `close()` ran (the report is written; the guard cannot be used again)."""
        return self._closed

    @property
    def folder(self) -> Path | None:
        """The run folder, or None when recording is off."""
        return getattr(self.store, "folder", None)

    @property
    def host_reads(self) -> int:
        """Host reads of step statistics made so far (one per step under the defaults)."""
        return self.steps.host_reads

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

    # ------------------------------------------------------------------ in the loop

    def watch(self, *, loss: torch.Tensor | float | None = None, batch: Any = None) -> None:
        """Hand the guard this step's loss and/or batch. Call any time before `optimizer.step()`.

        The loss is detached and kept on its device (no host read here). The batch (a tensor, or
        a tuple / list / dict of tensors sharing the leading batch dimension) is fingerprinted
        per sample on the device and kept by reference for replay.

        Raises:
            ValueError: the guard is closed (create a new one for another run).
        """
        if self._closed:
            raise ValueError(_CLOSED)
        self._pipe.watch(loss, batch)

    def watch_micro_batch(self, batch: Any) -> None:
        """Hand the guard another micro-batch of the step being watched (gradient
        accumulation), after `watch()` gave the first: kept beside the others, its samples
        numbered after theirs. Also under a GradScaler, where a second `watch(batch=...)`
        before the step means the scaler skipped a step."""
        self._pipe.watch_micro_batch(batch)

    def note_clip_norm(self, total_norm: torch.Tensor | float) -> None:
        """Give the guard the total gradient norm your own clipping measured before it clipped
        (what `clip_grad_norm_` returns), for the step in progress: call it after clipping,
        before `optimizer.step()`. The spike measures score the grad norm before clipping, as
        OLMo does (run.db `steps.clip_norm`). A tensor stays on its device until the step's
        read. `nanguard run` and the Lightning callback call this themselves."""
        self._pipe.note_clip_norm(total_norm)

    def before_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call when the gradients are final
        for the update (after backward and AMP unscale; before or after clipping, as the
        framework allows) and before the optimizer updates. Runs what the step pre-hook runs:
        reads, detects and, for `skip`, removes the gradients so the coming update is a no-op
        (`after_update` gives them back)."""
        if self._closed:
            raise ValueError(_CLOSED)
        if self.error is None:
            self._pipe.pre_hook(self.optimizer, (), {})
        elif self._pipe.exit is not None:  # stood down: the other ranks' agreement goes on
            self._pipe.exit.pay("pre")

    def after_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call right after the optimizer's
        update (or where it would have been, when the step was skipped)."""
        if self.error is None and not self._closed:
            self._pipe.post_hook(self.optimizer, (), {})
        elif self._pipe.exit is not None:
            self._pipe.exit.pay("post")

    def take_baselines(self, other: Guard) -> None:
        """Start this guard's detectors from `other`'s baselines (each series detector's
        window of healthy values and typical level), when this guard's optimizer replaces
        `other`'s over the same parameters (a new optimizer every epoch keeps its spike and
        divergence statistics). Episodes, cooldowns and runs of growth start afresh. Call it
        before this guard's first step; detectors of other classes or orders are left alone."""
        if self.step or len(other.detectors) != len(self.detectors):
            return
        for mine, theirs in zip(self.detectors, other.detectors, strict=True):
            take = getattr(mine, "take_baselines", None)  # the series detectors'
            if take is not None and type(mine) is type(theirs):
                take(theirs)

    def couple(self, *others: Guard) -> None:
        """Under `rollback`: roll back together with `others`, guards of other models trained
        on each other's outputs (a GAN's generator and discriminator). Guards of the same model
        are coupled already; `nanguard run` couples all the guards of a script."""
        for g in (self, *others):
            g.recovery.couple(self.model)

    def add_listener(self, listener: Listener, *, only: str | None = None) -> None:
        """Call `listener(event)` with every later `Event` (or, with `only`, those of one type:
        `alarm`, `action`, `finding`, `episode_end`, or `step`: each recorded step's signals,
        which only `only="step"` delivers), as it happens; errors inside it are contained (see
        `on_alarm`). `close` (also only with `only`): once, when `close()` has written the
        report (its dict in `data`). Exporters and framework adapters subscribe this way."""
        self.events.subscribe(listener, only)

    def record_action(self, step: int, action: str, detail: str) -> None:
        """Record what was done at `step` (report.json `actions`; written to run.db at once)."""
        self.log.add_action(step, action, detail)

    def record_alarm(self, alarm: Alarm) -> None:
        """Record an alarm raised outside the detectors: report.json `alarms`, run.db at
        once, an `alarm` event."""
        self.log.add_alarm(alarm)

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`recover.effects`)."""
        self._pipe.apply(effects)

    # ------------------------------------------------------------------ the end, and resuming

    def __enter__(self) -> Guard:
        if self._closed:
            raise ValueError(_CLOSED)
        return self

    def __exit__(self, tp: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if not self._closed:
            self.close(*ending.classify(exc))

    def close(self, ended: str | None = None, error: str | None = None) -> Report:
        """Remove every hook, read what is pending, write report.json, print the summary.
        Safe to call again; runs at interpreter exit if forgotten.

        Args:
            ended: `ok`, `error` (it raised or exited non-zero), `interrupted` (SIGINT /
                SIGTERM) or `stopped` (the `raise` policy); None: as far as nanguard saw.
            error: a one-line description of that error (report.json's `run.ended`).
        """
        if self._closed:
            assert self.report is not None
            return self.report
        self._ended = ending.settle(ended, error)
        self._closed = self._pipe.closed = True
        self.detach()
        self._pipe.parts.objective.close()  # no longer a peer of other guards
        atexit.unregister(self._atexit)
        ending.release()
        self._pipe.finish()  # fails open: a late error still leaves a report below
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
        self._pipe.detach()

    def stand_down(self, exc: BaseException, where: str) -> None:
        """An error inside nanguard's own code: record it (traceback in the run folder and in
        run.db), say so once, remove every hook and leave training exactly as it would run
        without nanguard. The report's status becomes `degraded` (unless a non-finite value
        was already seen: then the run had failed before nanguard stood down)."""
        self._pipe.stand_down(exc, where)

    def refine(self, finding: dict[str, Any]) -> Report:
        """After `close()`: take a refined first-non-finite finding (e.g. from a re-run with the
        op checker armed), diagnose again and rewrite report.json. Returns the new report."""
        self.log.set_finding(finding, write=False)
        return self._publish()

    def run_log(self) -> dict[str, Any]:
        """What this run has seen, as plain data: the first non-finite finding, alarms, actions,
        spikes, the steps that led into the failure, the failing step's batch flags, the
        optimizer's settings and how nanguard was started (`facts`). `explain` builds its
        evidence from it alone; `state_dict` carries it."""
        return self.log.plain(
            optimizer=self.optimizer, params=self.params, detectors=self.detectors,
            lead_window=self.config.detect.lead_window, facts=self.facts.as_log())

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume watching where this guard left off, the run log
        included (`run_log()`: history and failing step for a diagnosis after the resume)."""
        self._pipe.flush()
        return guard_state.gather(self._pipe.state, self._pipe.parts, self.run_log())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (e.g. when resuming from a checkpoint).

        The rollback snapshot is not part of the state (it is a full copy of the model): after
        a resume, the last good state is the state the guard was created with."""
        guard_state.restore(self._pipe.state, self._pipe.parts, state)

    def _publish(self, close_store: bool = False) -> Report:
        """Diagnose and build the report from the run log, write report.json (then close the
        run store, at close: the report reads run.db first) and announce a failed run's
        finding. Returns the report, kept in `report`."""
        st = self._pipe.state
        report = run_report(
            self.log, self.run_log(), optimizer=self.optimizer, model=self.model,
            policy=self.config.policy, entry=self.facts.entry, closed=self._closed,
            steps=st.step, ended=self._ended, last=st.last_stats, losses=st.losses,
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

