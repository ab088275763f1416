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
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import statistics
import sys
import time
import traceback
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
from nanguard.detect.locate import locate
from nanguard.errors import NanguardError
from nanguard.integrations import distributed
from nanguard.pinpoint.step_replay import activations_paused, carried_by, replay_batches
from nanguard.policy import device_skip, make_policy, wants_to_act
from nanguard.record import ending
from nanguard.record.events import EVENT_TYPES, Event, Events, Listener
from nanguard.record.report import Report, build_report
from nanguard.record.rows import step_signals, write_step
from nanguard.record.spike_run import measure_run
from nanguard.record.store import open_store
from nanguard.recover.policy import Recovery
from nanguard.recover.verdict import LossWatch
from nanguard.show import live
from nanguard.watch import loads, replicas, rng, saturation
from nanguard.watch.activations import ActivationProbe, dtype_max
from nanguard.watch.batch import BatchProbe
from nanguard.watch.stats import StepProbe, StepStats, local, watched_buffers
from nanguard.watch.step import Pending, StepWatch


class Guard:
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
        self.act_probe = ActivationProbe(model) if cfg.watch.activations else None
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

        self.step = 0
        self.alarms: list[Alarm] = []
        self.actions: list[dict[str, Any]] = []
        self.first_nonfinite: dict[str, Any] | None = None
        self.failing_stats: StepStats | None = None  # the step where it first showed
        self.history: deque[StepStats] = deque(maxlen=64)  # the last steps, for the summary
        self._last_stats: StepStats | None = None
        self._grad_baseline: dict[int, float] = {}  # per-parameter EMA of healthy grad norms
        self.spikes: list[dict[str, Any]] = []  # where each spike sits (layers, samples)
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
        self._recovered_from = False  # a skip or rollback was recorded
        self.report: Report | None = None
        self.events = Events(quiet_steps=max(cfg.detect.lead_window, 10))
        self.events.summary_follows = cfg.record.summary
        """Every alarm, action and finding as it happens; `add_listener` subscribes."""
        live.ensure_handler()
        self.events.add(live.log_event)
        for fn, kind in ((on_alarm, "alarm"), (on_action, "action"), (on_finding, "finding")):
            if fn is not None:
                self.add_listener(fn, only=kind)
        self._resumed: dict[str, Any] = {}  # run log from before a resume (`load_state_dict`)
        self.recovery = Recovery(RecoveryLink(self), scheduler=scheduler, scaler=scaler)
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
        self.replicas = replicas.attach(self, cfg.detect.replica_every)
        self._hooked = hook_optimizer
        self._in_hook: str | None = None  # `pre` / `post` while a step hook runs
        self._agreed = False  # that hook took part in its cross-rank agreement
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

    def _watch(self, loss: torch.Tensor | float | None, batch: Any) -> None:
        # With a GradScaler, watch() calls without a step in between are steps the scaler
        # skipped, not micro-batches: their values must not carry into the next step.
        accumulate = self.recovery.amp is None
        if loss is not None:
            t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            if t.dim():  # a 0-dim value, as the packet stacks them (its float64 read is exact)
                t = t.reshape(-1)[0]
            if self._loss is not None and self._loss.device == t.device and accumulate:
                # Several micro-batches per step (gradient accumulation): a non-finite loss of
                # an earlier one must not be hidden by the last one (kept on the device).
                t = torch.where(torch.isfinite(self._loss), t, self._loss)
            self._loss = t
            self._watch_calls += 1
            if self._watch_calls > self.config.amp.stall_steps:
                # No optimizer step for a while: a GradScaler may be skipping every step.
                self.recovery.check_stall(self.step)
        if batch is not None:
            self.batch_probe.observe(batch, accumulate=accumulate)

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
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.error = {"step": self.step, "where": where,
                      "error": f"{type(exc).__name__}: {exc}"}
        try:
            if self.folder is not None:
                (self.folder / "nanguard_error.txt").write_text(text)
                self.error["traceback"] = str(self.folder / "nanguard_error.txt")
            self.store.write_meta(internal_error=self.error)
        except Exception:  # noqa: BLE001, S110 - recording the error must not raise either
            pass
        print(f"nanguard: internal error in {where} at step {self.step} "
              f"({type(exc).__name__}: {exc}); nanguard stands down, training goes on"
              + (f"; traceback in {self.folder / 'nanguard_error.txt'}" if self.folder else ""),
              file=sys.stderr)
        if (self.config.policy != "observe" and distributed.active()
                and not isinstance(exc, distributed.PeerStoodDown)):
            # The other ranks agree every decision with this one: take part in the next
            # agreement, saying so, and every rank stands down in it (nobody waits).
            self._exit = distributed.LockstepExit(self.optimizer, self._agree_device,
                                                  hooked=self._hooked)
            if self._in_hook is not None and not self._agreed:
                self._exit.pay_now()  # the others are in this hook's agreement now
            else:
                self._exit.owe("post" if self._in_hook == "pre" else "pre")

    def _on_load(self, loaded: Any, *_: Any) -> None:
        """`load_state_dict` post-hook of the model and the optimizer: loaded values are
        checked for finiteness before the next update, and the line that loaded them kept."""
        self._check_loaded = True
        self._load_site = loads.call_site()
        loads.note(self._load_site, loaded)

    def refine(self, finding: dict[str, Any]) -> Report:
        """After `close()`: take a refined first-non-finite finding (e.g. from a re-run with the
        op checker armed), diagnose again and rewrite report.json. Returns the new report."""
        self.first_nonfinite = dict(finding)
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
        from nanguard.detect.detectors import SpikeDetector

        group = self.optimizer.param_groups[0] if self.optimizer.param_groups else {}
        momentum = group.get("momentum")
        if momentum is None and isinstance(group.get("betas"), (tuple, list)):
            momentum = group["betas"][0]
        healthy = None
        for d in self.detectors:
            if isinstance(d, SpikeDetector) and d.history["grad_norm"]:
                healthy = 10 ** statistics.median(d.history["grad_norm"])
        dtypes = {str(p.dtype) for p in self.params}
        failing = self.failing_stats
        name = type(self.optimizer).__name__
        return {
            "first_nonfinite": self.first_nonfinite,
            "alarms": [a.to_dict() for a in self.alarms],
            "actions": list(self.actions),
            "spikes": list(self.spikes),
            "optimizer": {
                # `nanguard run`'s stand-in for hand-written updates is no optimizer the user
                # knows.
                "name": "your hand-written update" if name == "ManualStep" else name,
                "lr": group.get("lr") if isinstance(group.get("lr"), (int, float)) else None,
                "momentum": momentum if isinstance(momentum, (int, float)) else None,
                "eps": group.get("eps") if isinstance(group.get("eps"), (int, float)) else None,
                "dtype": dtypes.pop() if len(dtypes) == 1 else None,
            },
            "failing": self._resumed.get("failing") if failing is None else {
                "step": failing.step, "lr": failing.lr,
                "bad_tensors": list(failing.nonfinite_tensors),
                "n_batch_tensors": failing.batch_tensors,
            },
            "healthy_grad_norm": healthy,
            "history": self._resumed.get("history", []) + [s.record() for s in self.history],
            "lead_window": self.config.detect.lead_window,
            "script_clip": self.script_clip,
            "entry": getattr(self, "run_entry", "api"),
            "preflight": self.preflight,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume watching where this guard left off, the run log
        included (`run_log()`: history and failing step for a diagnosis after the resume)."""
        self._flush()
        log = self.run_log()
        return {
            "step": self.step,
            "detectors": [d.state_dict() for d in self.detectors],
            "alarms": [a.to_dict() for a in self.alarms],
            "actions": list(self.actions),
            "first_nonfinite": self.first_nonfinite,
            "recovery": self.recovery.state_dict(),
            "grad_baseline": {str(i): v for i, v in self._grad_baseline.items()},
            "spikes": list(self.spikes),
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
        self.alarms = [Alarm(**a) for a in state["alarms"]]
        self.actions = list(state["actions"])
        self._recovered_from = any(
            a["action"] in ("skip", "rollback", "heal_clip", "wd_cut", "lr_cut")
            for a in self.actions)
        self.first_nonfinite = state["first_nonfinite"]
        if "recovery" in state:
            self.recovery.load_state_dict(state["recovery"])
        self._grad_baseline = {int(i): float(v) for i, v in state.get("grad_baseline", {}).items()}
        self.spikes = list(state.get("spikes", []))
        self._resumed = dict(state.get("log") or {})

    # ------------------------------------------------------------------ hooks

    @property
    def _device(self) -> torch.device:
        """Where a step's packet is gathered: the first parameter's device (read each step: the
        model may be moved after the guard was built)."""
        return local(self.params[0]).device if self.params else torch.device("cpu")

    def _sync_params(self) -> bool:
        """Follow the optimizer's parameters (`add_param_group` after the guard was built).
        Appending keeps every earlier parameter's index. Returns whether they changed."""
        n = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if n == len(self.params):
            return False
        named = list(self.model.named_parameters())
        names = {id(p): name for name, p in named}
        order = {id(p): k for k, (_, p) in enumerate(named)}
        self.params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.param_names = [names.get(id(p), f"param{i}") for i, p in enumerate(self.params)]
        # Where each parameter sits in the model's module order (not the optimizer's group
        # order): backward reaches the last module first, whatever the groups say.
        self._param_order = [order.get(id(p), len(named) + i) for i, p in enumerate(self.params)]
        self.probe.params = self.params
        self.probe._update_buf = None  # reallocated for the new set at the next sample
        return True

    def _loaded_flags(self) -> tuple[list[str], torch.Tensor | None]:
        """Before the first update (and the first after a `load_state_dict`): finiteness flags
        of every parameter, optimizer-state tensor and buffer, riding in that step's packet."""
        if self.first_nonfinite is not None:
            return [], None
        return loads.finiteness_flags(self.param_names, self.params, self.optimizer,
                                      self.buffer_names, self.probe.buffers)

    def _loaded_finding(self, step: int, names: list[str], flags: list[float]) -> None:
        """The first non-finite finding for loaded state (phase `checkpoint`)."""
        if self.first_nonfinite is not None:
            return
        found = loads.finding(step, names, flags, self._load_site or loads.last_site())
        if found is not None:
            found["rank"] = distributed.rank()
            self.first_nonfinite = found
            self.store.write_finding(found)

    def _check_leftover(self) -> None:
        """At close: a loss or batch handed to `watch` after the last optimizer step (the run
        died in its first iteration, or before the next step) is checked too, so a NaN that
        never reached an optimizer step is not lost. One host read, only when there is one."""
        if self.first_nonfinite is not None:
            return
        stats = self.steps.leftover(self.step, self._device, self._loss)
        self._loss = None
        if stats is not None and (stats.nonfinite_signals() or stats.nonfinite_samples):
            found = self._locate(stats)
            found["signals"] = found["signals"] or ["data"]
            self.first_nonfinite = found
            self.failing_stats = stats
            self.store.write_finding(found)

    def _write_params(self) -> None:
        self.store.write_params([(n, tuple(p.shape), p.numel())
                                 for n, p in zip(self.param_names, self.params, strict=True)])

    def _pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Runs inside `optimizer.step()`, after backward and clipping, before the update.

        Fails open: an error of nanguard's own stands it down (`_stand_down`) and the step goes
        on untouched; only the `raise` policy's NanguardError leaves this hook."""
        self._in_hook, self._agreed = "pre", False
        try:
            self._pre(optimizer)
        except NanguardError:
            raise
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "optimizer step pre-hook")
        finally:
            self._in_hook = None

    def _post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Runs inside `optimizer.step()`, right after the update. Fails open like `_pre_hook`."""
        if self._current is None:  # stood down in the pre-hook of this very step
            return
        self._in_hook, self._agreed = "post", False
        try:
            self._post()
        except NanguardError:
            raise
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "optimizer step post-hook")
        finally:
            self._in_hook = None

    def _pre(self, optimizer: torch.optim.Optimizer) -> None:
        cfg = self.config
        if self._sync_params():
            self._write_params()
        loaded: list[str] = []
        flags: torch.Tensor | None = None
        if self._check_loaded:
            self._check_loaded = False
            loaded, flags = self._loaded_flags()
        self._current, grads = self.steps.begin(
            self.step, _lr(optimizer), self._device, self._loss, self.recovery.scale_tensor(),
            loaded, flags, self._step_rng)
        pre = self._current.pre
        self._loss = None
        self._watch_calls = 0
        replaying = self.replay is not None and self.first_nonfinite is None
        if cfg.policy == "observe" and not replaying and cfg.clip is None:
            return
        if not replaying and cfg.clip is None and device_skip.applies(
                cfg, self.optimizer, grads, scaler_watched=self.recovery.amp is not None):
            # `skip` on the non-finite values alone, with a fused optimizer: the verdict goes to
            # the optimizer as its `found_inf` flag, no host read; recorded at the read.
            assert grads is not None
            found = device_skip.arm(optimizer, pre.slot("loss"), grads)
            pre.add("found_inf", found)
            self._current.device_skip = True
            return
        # Acting policies decide before the update, and a replay needs the parameters as they
        # were before it: read the pre-step statistics now.
        stats = self.steps.read_pre(self._current)
        alarms = self._detect(stats, "pre", self._current.rng)
        if replaying and self.first_nonfinite is not None:
            self._pinpoint(stats, self._current)
        elif replaying and stats.amp_skipped:
            self._check_scaler_skip(stats)
        if cfg.policy != "observe" and self._decide(stats, alarms):
            self._act(stats, alarms)
        if not stats.skipped:
            self._skips_in_row = 0
            self.recovery.before_update(stats)
            stats.lr = _lr(optimizer)  # the LR this update really uses (after any backoff)

    def _replay_batches(self, batches: list[Any], stats: StepStats,
                        step_rng: dict[str, Any] | None) -> dict[str, Any] | None:
        """`pinpoint.step_replay.replay_batches` with this guard's model and replay."""
        assert self.replay is not None
        return replay_batches(self.replay, model=self.model, params=self.params,
                              batches=batches, step=stats.step, loss=stats.loss,
                              step_rng=step_rng, act_probe=self.act_probe)

    def _check_scaler_skip(self, stats: StepStats) -> None:
        """The GradScaler skipped the step before this one: an fp16 overflow, or a real fault
        (sqrt at 0, a NaN row) that it hid? With `replay`, its batch is replayed in float32
        (outside autocast) from the same parameters (a skipped step changed none): a value
        that is non-finite there too was not an overflow. One replay per skip, until found."""
        skipped, self.batch_probe.skipped = self.batch_probe.skipped, []
        if not skipped or self.replay is None or self.first_nonfinite is not None:
            return
        try:
            found = self._replay_batches(skipped, stats, None)
        except Exception:  # noqa: BLE001 - the skip stays what the scaler said it was
            return
        if found is None:
            return
        found.update(step=stats.step, rank=distributed.rank(), signals=["grad"],
                     skipped_by="GradScaler")
        self.first_nonfinite = found
        self.failing_stats = stats
        self.store.write_finding(found)
        self.events.finding(found)

    def _pinpoint(self, stats: StepStats, cur: Pending) -> None:
        """Refine the first non-finite finding by replaying this step before its update."""
        assert self.replay is not None and self.first_nonfinite is not None
        if self.first_nonfinite.get("phase") == "checkpoint":
            return  # loaded non-finite: no op of this step made it, nothing to replay
        # NaN rows of a batch the GradScaler skipped: that batch is the one to replay.
        batches = (self.batch_probe.skipped if stats.dropped_samples and self.batch_probe.skipped
                   else self.batch_probe.step_batches or [self.batch_probe.last])
        try:
            found = self._replay_batches(batches, stats, None if stats.dropped_samples
                                         else cur.rng)
        except Exception as exc:  # noqa: BLE001 - a failing replay must not kill training
            self.first_nonfinite["replay_error"] = f"{type(exc).__name__}: {exc}"
            return
        if found is None:
            # The same step from the same parameters, RNG states and batch ran clean: what
            # made the value is not in them (a non-deterministic kernel, state outside the
            # RNG, a device fault: `pinpoint.rerun`).
            self.first_nonfinite.update(reproduced=False, verdict="transient")
            self.store.write_finding(self.first_nonfinite)
            self.events.finding(self.first_nonfinite)
            return
        signals = self.first_nonfinite.get("signals")
        self.first_nonfinite.update({k: v for k, v in found.items()
                                     if v is not None or k == "reproduced"})
        if isinstance(found.get("reproduced"), bool):  # the replay re-ran the step bit for bit
            self.first_nonfinite["verdict"] = ("reproducible" if found["reproduced"]
                                               else "transient")
        self.first_nonfinite["signals"] = signals
        self.store.write_finding(self.first_nonfinite)
        self.events.finding(self.first_nonfinite)

    def _post(self) -> None:
        cur = self._current
        assert cur is not None, "post-step hook without a pre-step hook"
        self._current = None
        self.recovery.after_update()  # the scheduler's LR back before anything reads it
        if cur.device_skip:
            device_skip.disarm(self.optimizer)
        if self._stashed_grads is not None:  # `skip`: give the user their gradients back
            for p, g in zip(self.params, self._stashed_grads, strict=True):
                p.grad = g
            self._stashed_grads = None
        copying = self.steps.end(cur)
        self.step += 1
        self._pending.append(cur)
        if copying:
            # `observe` on a GPU: no stall. This step's packet is on its way to pinned host
            # memory; it is read one step later (its copy long done), or at close.
            if len(self._pending) > self.config.watch.read_every:
                older, self._pending = self._pending[:-1], self._pending[-1:]
                self._flush(older, live_last=False)
        # Acting policy (pre already read): read the post part now; else every N steps.
        elif cur.stats is not None or len(self._pending) >= self.config.watch.read_every:
            self._flush()
        if cur.stats is not None:
            self.recovery.maybe_snapshot(cur.stats)
        if self.act_probe:  # activations on sampled steps only
            self.act_probe.enabled = self.step % self.config.watch.activations_every == 0
        if self.step % self.config.record.rng_every == 0:  # kept: every generator
            self._step_rng = rng.capture()
            self.store.write_rng(self.step, rng.dumps(self._step_rng))
        else:  # every step: torch's generators, what a replay of the step draws from
            self._step_rng = rng.capture_step()

    # ------------------------------------------------------------------ reading and deciding

    def _flush(self, pending: list[Pending] | None = None, live_last: bool = True) -> None:
        """Read `pending` steps (default: every pending step) at once, then detect and record
        them in step order. `live_last`: the newest of them is the step that just ended (its
        gradients and parameters are still those it measured)."""
        if pending is None:
            pending, self._pending = self._pending, []
        if not pending:
            return
        observing = self.config.policy == "observe"
        for p, stats, fresh in self.steps.read_steps(pending, live_last):
            if p.device_skip:
                self._device_skipped(p, stats)
            if fresh and observing:  # both phases in one pass: nothing acts on the pre ones
                alarms = self._detect(stats, "both", p.rng)
            else:
                if fresh:
                    self._detect(stats, "pre", p.rng)
                alarms = self._detect(stats, "post", p.rng)
            # Recorded before acting: `raise` and a rollback give-up stop inside `_act`.
            self._record(stats, p)
            if not observing and self._decide(stats, alarms, post=True):
                self._act(stats, alarms, post=True)

    def _detect(
        self, stats: StepStats, phase: str, step_rng: dict[str, Any] | None = None
    ) -> list[Alarm]:
        """Run the detectors of `phase` (`pre`, `post`, or `both`: pre then post, for a step
        read after its update where nothing acts between the two) on `stats`; record their
        alarms on the guard and the step."""
        alarms: list[Alarm] = []
        if phase != "post":
            alarms += self.recovery.check_amp(stats)
            if stats.amp_skipped and stats.activations:
                # The activations include the forward of a step the GradScaler skipped on an
                # expected fp16 overflow: its inf/NaN are not this step's (nor an alarm).
                stats.activations = {m: v for m, v in stats.activations.items()
                                     if math.isfinite(v)}
                stats._signals = None
        signals = stats.seal()  # final for this phase (decoding unseals): scan once
        for d in self._by_phase[phase]:
            alarms += d.check(stats)
        for a in alarms:
            if a.kind == "spike":
                self._explain_spike(stats, a)
        if signals:
            if self.first_nonfinite is None:
                self.first_nonfinite = self._locate(stats)
            if self.failing_stats is None:
                self.failing_stats = stats
        if alarms and step_rng is not None:
            # Keep the RNG state at the start of an alarmed step: a replay needs it.
            self.store.write_rng(stats.step, rng.dumps(step_rng))
        self.alarms += alarms
        stats.alarms += alarms
        if alarms:
            self.events.alarms([a.to_dict() for a in alarms])
        return alarms

    @property
    def _agree_device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _decide(self, stats: StepStats, alarms: list[Alarm], post: bool = False) -> bool:
        """This rank's verdict, agreed with every other rank under torch.distributed: all ranks
        act in the same step, or none does (one small int32 all-reduce). Raises
        `PeerStoodDown` when another rank's guard stood down (this one then does too)."""
        act = wants_to_act(stats, alarms, self.config.acting_on, post)
        if not distributed.active():
            return act
        phase = self._locate(stats)["phase"] or "" if stats.nonfinite_signals() else None
        act, bad_rank = distributed.agree(act, phase, self._agree_device)
        self._agreed = True
        if bad_rank is not None:
            stats.agreed_bad_rank = bad_rank
        return act

    def _act(self, stats: StepStats, alarms: list[Alarm], post: bool = False) -> None:
        """Apply what the policy stage decides for this step (see `nanguard.policy`)."""
        d = self.policy.decide(stats, alarms, post=post, skips_in_row=self._skips_in_row)
        if d.action == "skip":
            self.discard_update(stats)
            self._skips_in_row += 1
            self._action(stats.step, "skip", f"update discarded ({d.why})")
        elif d.action == "discard_spike":
            # The spike was seen before its update: no rollback, no LR change, nothing counted.
            self.discard_update(stats)
            self._action(stats.step, "skip", f"update discarded ({d.why}): the state before it "
                         "is still good, no rollback needed")
        elif d.action == "rollback":
            self.recovery.rollback(stats, d.why, post)
        elif d.action == "escalate":
            limit = self.config.recover.max_consecutive_skips
            if self.recovery.escalate(stats, f"{limit} skips in a row ({d.why})", post):
                self._skips_in_row = 0  # recover.skip_escalation="rollback" rolled back
                return
            detail = (f"{self._skips_in_row} updates discarded in a row and the next is "
                      f"bad too ({d.why}); skipping does not heal this run: stopped")
            self._action(stats.step, "give_up", detail)
            self.stop(stats, detail)
        elif d.action == "cannot_skip":
            # The update itself produced the non-finite value; undoing it needs a saved copy,
            # which is the `rollback` policy's job. Record that it could not be skipped.
            if not self.recovery.escalate(stats, d.why, post):  # skip_escalation="rollback"
                self._action(stats.step, "none",
                             f"non-finite after the update ({d.why}); cannot skip")
        elif d.action == "raise":
            self._action(stats.step, "raise", f"stopped ({d.why})")
            self.stop(stats, d.why)

    def _device_skipped(self, p: Pending, stats: StepStats) -> None:
        """Record what the fused optimizer did with the `found_inf` flag of step `p` (read a
        step late on a GPU): a discarded update is a `skip` action; too many in a row stop the
        run, as the host-side `skip` does."""
        if not p.found_inf:
            self._skips_in_row = 0
            return
        stats.skipped = True
        self._skips_in_row += 1
        why = ", ".join(stats.seal()) or "non-finite gradient norm"
        self._action(stats.step, "skip", f"update discarded on the device ({why})")
        limit = self.config.recover.max_consecutive_skips
        if self._skips_in_row > limit:
            detail = (f"{limit} updates discarded in a row and the next was bad too ({why}); "
                      "skipping does not heal this run: stopped")
            self._action(stats.step, "give_up", detail)
            self.stop(stats, detail)

    def discard_update(self, stats: StepStats) -> None:
        """Make the coming `optimizer.step()` a no-op: optimizers leave a parameter whose .grad
        is None untouched (no update, no state change, no step-counter increment). The
        post-hook puts the gradients back."""
        if self._stashed_grads is None:
            self._stashed_grads = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
        stats.skipped = True

    def stop(self, stats: StepStats, why: str) -> None:
        """Close the run and raise NanguardError with the report (the `raise` policy's end)."""
        if self._current is not None:
            self._record(stats, self._current)
            self._current = None
        message = f"nanguard stopped training at step {stats.step}: {why}"
        report = self.close("stopped", message)
        raise NanguardError(message, report)

    def record_action(self, step: int, action: str, detail: str) -> None:
        """Record what was done at `step` (report.json `actions`; written to run.db at once)."""
        self.actions.append({"step": step, "action": action, "detail": detail})
        self._recovered_from |= action in ("skip", "rollback", "heal_clip", "wd_cut", "lr_cut")
        self.store.write_action(step, action, detail)
        self.events.action(step, action, detail)

    _action = record_action

    def record_alarm(self, alarm: Alarm) -> None:
        """Record an alarm raised outside the detectors (e.g. recovery's `amp_collapse`)."""
        self.alarms.append(alarm)
        self.store.write_alarm(alarm.to_dict())
        self.events.alarm(alarm.to_dict())

    # ------------------------------------------------------------------ recording

    def _locate(self, stats: StepStats) -> dict[str, Any]:
        found = locate(stats, self.param_names, distributed.rank(), order=self._param_order,
                       buffer_names=self.buffer_names)
        if stats.dropped_samples:  # the batch of a step the GradScaler skipped
            found["skipped_by"] = "GradScaler"
        return found

    def _explain_spike(self, stats: StepStats, alarm: Alarm) -> None:
        """Which layers carry a spike (always) and which samples cause it (with `replay`,
        when the spike is seen before its update, so the parameters are the step's own)."""
        from nanguard.pinpoint.inprocess import spike_sources

        before_update = self._current is not None and self._current.stats is stats
        compute = self.replay if before_update else None
        try:
            with activations_paused(self.act_probe):  # per-sample forwards: not the step's
                found = spike_sources(
                    compute or (lambda _batch: torch.zeros(())), model=self.model,
                    params=self.params, param_names=self.param_names,
                    batch=self.batch_probe.last, grad_norms=stats.grad_norms,
                    baseline=self._grad_baseline,
                    batch_size=len(stats.sample_hashes) if compute else 0,
                    step_rng=self._current.rng if before_update and self._current else None,
                )
        except Exception as exc:  # noqa: BLE001 - an explanation must never stop training
            found = {"layers": [], "samples": [], "error": f"{type(exc).__name__}: {exc}"}
        if compute is not None:
            found["rerun"] = self._rerun(stats, compute)
        self.spikes.append({"step": stats.step, **found})
        alarm.message += carried_by(found)
        if found.get("rerun", {}).get("verdict"):
            alarm.message += f"; re-run: {found['rerun']['verdict']}"

    def _rerun(self, stats: StepStats, compute: Callable[[Any], torch.Tensor]
               ) -> dict[str, Any]:
        """Does the alarmed step (before its update) re-run the same? (`pinpoint.rerun`).
        Only for a step one batch made, without a GradScaler (its gradients are scaled)."""
        from nanguard.pinpoint.rerun import rerun_verdict

        if len(self.batch_probe.step_batches) > 1 or self.recovery.amp is not None:
            return {"verdict": None, "why": "several micro-batches or a GradScaler: the step's "
                    "gradients are not one re-runnable forward and backward"}
        try:
            with activations_paused(self.act_probe):
                return rerun_verdict(compute, model=self.model, params=self.params,
                                     batch=self.batch_probe.last,
                                     step_rng=self._current.rng if self._current else None,
                                     loss=stats.loss)
        except Exception as exc:  # noqa: BLE001 - a verdict must never stop training
            return {"verdict": None, "why": f"the re-run failed: {type(exc).__name__}: {exc}"}

    def _record(self, stats: StepStats, p: Pending) -> None:
        self._last_stats = stats
        self._losses.observe(stats.loss, stats.skipped,
                             troubled=self.first_nonfinite is not None or self._recovered_from)
        if not stats.alarms and not stats.nonfinite_signals():
            # Each parameter's typical grad norm on healthy steps: the baseline of a spike.
            base = self._grad_baseline
            base.update({i: v if (prev := base.get(i)) is None else 0.9 * prev + 0.1 * v
                         for i, v in stats.grad_norms.items()})
        # Keep the steps up to the first non-finite value: what led into it is the story.
        if self.first_nonfinite is None or stats.step <= self.first_nonfinite["step"] + 1:
            self.history.append(stats)
        write_step(self.store, stats, len(self.params), self.config.watch.per_parameter)
        events = self.events
        if events.episodes.start is not None:  # an episode is open (a quiet step: nothing)
            events.tick(stats.step, bool(stats.nonfinite_signals()))
        if events.step_listeners:
            events.step(stats.step, step_signals(stats))

    def _build_report(self) -> Report:
        from nanguard.explain import diagnose
        from nanguard.explain.context import evidence_from_run

        ended, message = getattr(self, "_ended", ("ok", None))
        recovery = self._recovery_verdict()
        if recovery is not None:
            # What recovering cost: updates discarded or undone, LR changes, snapshot memory.
            recovery["updates_skipped"] = sum(a["action"] == "skip" for a in self.actions)
            recovery.update(self.recovery.cost() or {})

        causes = diagnose(evidence_from_run(self.run_log(), self.optimizer))
        return build_report(
            steps=self.step,
            alarms=[a.to_dict() for a in self.alarms],
            actions=list(self.actions),
            first_nonfinite=self.first_nonfinite,
            diagnosis=[c.to_dict() for c in causes],
            spikes=self.spikes,
            # From run.db, off the training thread; all steps are in it after close's flush.
            spike_measures=measure_run(self.folder),
            # Ended non-finite: the last recorded step still holds a NaN/Inf somewhere; or it
            # died of an error after a non-finite value appeared (BCE's range check, ...).
            failed=bool(self._last_stats and self._last_stats.nonfinite_signals())
            or (self.first_nonfinite is not None and ended == "error")
            or (self.first_nonfinite is not None and self._last_stats is None)
            or (recovery is not None and recovery["back"] is False),
            lead_window=self.config.detect.lead_window,
            ended=ended,
            degraded=self.error is not None,
            run={"folder": str(self.folder) if self.folder else None,
                 "policy": self.config.policy, "model": type(self.model).__name__,
                 "optimizer": type(self.optimizer).__name__, "version": __version__,
                 "closed": self._closed, "entry": self.run_entry,
                 "ended": {"how": ended, "error": message},
                 **({"recovery": recovery} if recovery else {}),
                 **({"internal_error": self.error} if self.error else {}),
                 **({"listener_errors": self.events.errors} if self.events.errors else {})},
        )

    def _recovery_verdict(self) -> dict[str, Any] | None:
        """After a skip or rollback: is the model back (`recover.verdict.LossWatch`)? None when
        nothing was recovered from."""
        return self._losses.verdict() if self._recovered_from else None

    # The store a new guard records to; `integrations.replay.record_nothing` swaps it.
    _open_store = staticmethod(open_store)


class RecoveryLink:
    """What recovery may use of its guard (`nanguard.recover.policy.GuardLink`), over a weak
    reference: recovery never keeps a dropped guard alive, and never imports this module."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def __init__(self, guard: Guard) -> None:
        self._guard = weakref.proxy(guard)
        self.config = guard.config
        self.model = guard.model
        self.optimizer = guard.optimizer

    @property
    def step(self) -> int:
        return int(self._guard.step)

    @property
    def active(self) -> bool:
        try:
            return not self._guard.closed and self._guard.error is None
        except ReferenceError:
            return False

    def record_action(self, step: int, action: str, detail: str) -> None:
        self._guard.record_action(step, action, detail)

    def record_alarm(self, alarm: Alarm) -> None:
        self._guard.record_alarm(alarm)

    def discard_update(self, stats: StepStats) -> None:
        self._guard.discard_update(stats)

    def stop(self, stats: StepStats, why: str) -> None:
        self._guard.stop(stats, why)

    def spikes(self) -> list[dict[str, Any]]:
        return list(self._guard.spikes)


def _lr(optimizer: torch.optim.Optimizer) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None
