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

How it fits together: the Guard is the public face and the run's lifecycle. It holds one
`step.pipeline.StepPipeline`, whose optimizer step pre-hook runs after backward and clipping,
before the update, and post-hook right after: they measure the step, judge it (detectors, the
first non-finite finding, the policy) and record it. Its parts are made once by `step.build`;
what carries between steps is `step.state.StepState`; the run log writes the record, from
which `close()` builds the report (`step.closing`).
"""

from __future__ import annotations

import atexit
import operator
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
from nanguard.record.events import Listener
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.recover.effects import Effect
from nanguard.step import closing
from nanguard.step.build import settle_config
from nanguard.step.pipeline import StepPipeline
from nanguard.step.state import RunFacts
from nanguard.watch.stats import StepStats

_CLOSED = "this Guard is closed: create a new Guard for another run"


def _view(path: str) -> Any:
    """A read-only attribute of the Guard that reads `path` (dotted) from it."""
    return property(operator.attrgetter(path))


class Guard:
    """Watches `model` trained by `optimizer`; see the module docstring for the loop.

    Args:
        model: the model being trained (any `nn.Module`).
        optimizer: its optimizer; the guard hooks its `step()`.
        policy: `observe` (default, changes nothing), `raise`, `skip`, `rollback` or `heal`
            (`HealConfig`: scales down a jumping gradient, cuts LR or weight decay on
            recurring jumps, skips non-finite updates); overrides `config`.
        out: run folder; None picks `nanguard_runs/<time>`, "" records nothing.
        activations: also watch per-module activation abs-max and headroom.
        replay: `replay(batch) -> loss`, your forward and loss: the first non-finite step is
            replayed under the op checker before its update (its op, module, line, samples).
        scheduler: the LR scheduler, if any: `rollback` restores it.
        scaler: the `torch.amp.GradScaler`, if any: `rollback` restores it; its skipped steps
            are counted, a collapsing scale alarms.
        config: full settings; the keyword arguments above override its fields.
        hook_optimizer: hook `optimizer.step()` (default). False: a framework adapter marks
            the step boundary with `before_update()` / `after_update()`.
        on_alarm: called with an `Event` for every alarm as recorded (inside the
            `optimizer.step()` that raised it; under `observe` on a GPU one step later); an
            exception inside one is logged once and the callback dropped.
        on_action: the same, for every action.
        on_finding: the same, for the first non-finite finding.
        facts: how nanguard was started (`step.state.RunFacts`: entry point, the script's
            clip and argv, the preflight's verdict); adapters and `nanguard run` pass theirs.

    Raises:
        ValueError: on arguments that cannot work (an unknown policy, an unwritable folder).
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
        self.store, self.detectors, self.recovery = parts.store, parts.detectors, parts.recovery
        self.probe, self.act_probe = parts.probe, parts.act_probe
        self.batch_probe, self.policy = parts.batch_probe, parts.policy
        self.saturation, self.replicas = parts.saturation, parts.replicas
        pipe.attach(hook_optimizer)  # after the saturation probe's and replica check's hooks
        self._atexit = ending.close_at_exit(self)
        ending.acquire()

    # ------------------------------------------------------------------ what it has seen
    # Read-only views of the pipeline's state and the run log (they own the values).

    step: int = _view("_pipe.state.step")
    """Optimizer steps completed."""
    params: list[torch.Tensor] = _view("_pipe.state.params")
    """The watched parameters, as the optimizer holds them; `param_names`: their names."""
    param_names: list[str] = _view("_pipe.state.param_names")
    error: dict[str, Any] | None = _view("_pipe.error")
    """Set when nanguard stood down after an error in its own code (`stand_down`)."""
    closed: bool = _view("_closed")
    """True once `close()` ran (the report is written; the guard cannot be used again)."""
    host_reads: int = _view("steps.host_reads")
    """Host reads of step statistics made so far (one per step under the defaults)."""
    alarms: list[Alarm] = _view("log.alarms")
    """Every alarm so far, in the order recorded."""
    actions: list[dict[str, Any]] = _view("log.actions")
    """Every action so far (`step`, `action`, `detail`), as report.json's `actions`."""
    spikes: list[dict[str, Any]] = _view("log.spikes")
    """Where each spike sits (step, layers, samples), as report.json's `spikes`."""
    history: deque[StepStats] = _view("log.history")
    """The last recorded steps, up to one past the first non-finite one."""
    failing_stats: StepStats | None = _view("log.failing")
    """The statistics of the step where the first non-finite value showed."""
    run_entry: str = _view("facts.entry")
    """How the user runs nanguard (`facts`): `api`, `run`, `lightning` or `transformers`."""
    script_clip: float | None = _view("facts.script_clip")
    """The `max_norm` of the script's own clipping, 0 when off (`facts`)."""
    script_argv: list[str] = _view("facts.script_argv")
    """The command line the training script was started with (`facts`)."""
    preflight: dict[str, Any] | None = _view("facts.preflight")
    """`nanguard run --preflight`: its verdict (`facts`)."""
    folder: Path | None = _view("store.folder")
    """The run folder, or None when recording is off."""

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
        """Hand the guard this step's loss and/or batch, any time before `optimizer.step()`: the
        loss stays on its device; the batch (tensors sharing the leading dimension) is
        fingerprinted per sample and kept for replay. ValueError once the guard is closed."""
        if self._closed:
            raise ValueError(_CLOSED)
        self._pipe.watch(loss, batch)

    def watch_micro_batch(self, batch: Any) -> None:
        """Hand the guard another micro-batch of the step being watched (gradient
        accumulation), after `watch()` gave the first: its samples numbered after theirs."""
        self._pipe.watch_micro_batch(batch)

    def note_clip_norm(self, total_norm: torch.Tensor | float) -> None:
        """Give the guard what your `clip_grad_norm_` returned, before `optimizer.step()`.

        Read with the step's own values (no extra host read). The grad-norm detectors judge
        it, not the clipped gradients (a clip below the usual norm makes every step read
        `max_norm`: a bad batch's spike was invisible), the spike measures score it, as OLMo
        does, run.db keeps it as `steps.clip_norm`, and a spike's re-run compares its
        gradients through it. `nanguard run` calls this for you. A DTensor total (FSDP2) is
        ignored: its value needs a collective."""
        self._pipe.note_clip_norm(total_norm)

    def before_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call when the gradients are final
        (after backward and AMP unscale), before the optimizer updates. Runs the step
        pre-hook (for `skip`, the gradients are taken away until `after_update`)."""
        if self._closed:
            raise ValueError(_CLOSED)
        self._pipe.before_update()

    def after_update(self) -> None:
        """For adapters built with `hook_optimizer=False`: call right after the update."""
        self._pipe.after_update()

    def take_baselines(self, other: Guard) -> None:
        """Start this guard's series detectors from `other`'s baselines (healthy windows and
        typical levels; episodes and cooldowns start afresh), when this guard's optimizer
        replaces `other`'s over the same parameters. Call it before this guard's first step."""
        if not self.step:
            guard_state.take_baselines(self.detectors, other.detectors)

    def couple(self, *others: Guard) -> None:
        """Under `rollback`: roll back together with `others`, guards of models trained on each
        other's outputs (a GAN); guards of one model, or of one `nanguard run`, are coupled."""
        for g in (self, *others):
            g.recovery.couple(self.model)

    def add_listener(self, listener: Listener, *, only: str | None = None) -> None:
        """Call `listener(event)` with every later `Event` as it happens (errors inside it are
        contained), or only those of one type: `alarm`, `action`, `finding`, `episode_end`,
        `step` (each step's signals) or `close` (once, the report's dict in `data`)."""
        self.events.subscribe(listener, only)

    def record_action(self, step: int, action: str, detail: str) -> None:
        """Record what was done at `step` (report.json `actions`; written to run.db at once)."""
        self.log.add_action(step, action, detail)

    def record_alarm(self, alarm: Alarm) -> None:
        """Record an alarm raised outside the detectors (report.json, run.db, an event)."""
        self.log.add_alarm(alarm)

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`recover.effects`)."""
        self._pipe.apply(effects)

    # ------------------------------------------------------------------ the end, and resuming

    def __enter__(self) -> Guard:
        if self._closed:
            raise ValueError(_CLOSED)
        return self

    def __exit__(self, tp: object, exc: BaseException | None, tb: object) -> None:
        if not self._closed:
            self.close(*ending.classify(exc))

    def close(self, ended: str | None = None, error: str | None = None) -> Report:
        """Remove every hook, read what is pending, write report.json, print the summary; safe
        to call again, runs at exit if forgotten. `ended`: `ok`, `error`, `interrupted` or
        `stopped` (None: as nanguard saw it), `error` its one line (report.json `run.ended`)."""
        if self._closed:
            assert self.report is not None
            return self.report
        self._ended = ending.settle(ended, error)
        self._closed = True
        atexit.unregister(self._atexit)
        ending.release()
        self.report = report = closing.close_run(self._pipe, self.facts, self._ended)
        if self.config.record.summary:
            from nanguard.show.summary import print_summary

            print_summary(report, self.history)
        return report

    def detach(self) -> None:
        """Remove every hook of this guard, closing nothing (a forked child's way out)."""
        self._pipe.detach()

    def stand_down(self, exc: BaseException, where: str) -> None:
        """An error inside nanguard's own code: record it (traceback in the run folder and
        run.db), say so once, remove every hook and let training run as without nanguard.
        The status becomes `degraded` (`failed` if a non-finite value was seen before)."""
        self._pipe.stand_down(exc, where)

    def refine(self, finding: dict[str, Any]) -> Report:
        """After `close()`: take a refined first-non-finite finding (e.g. from a re-run with the
        op checker armed), diagnose again and rewrite report.json. Returns the new report."""
        self.log.set_finding(finding, write=False)
        self.report = closing.publish(self._pipe, self.facts, ended=self._ended)
        return self.report

    def run_log(self) -> dict[str, Any]:
        """What this run has seen, as plain data: the finding, alarms, actions, spikes, the
        steps into the failure, the optimizer's settings and `facts`; `explain` reads it."""
        return closing.run_log(self._pipe, self.facts)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume watching where this guard left off (`guard_state`)."""
        self._pipe.flush()
        self._pipe.parts.steps.saw_save()  # a checkpoint save: the next step samples the state
        return guard_state.gather(self._pipe.state, self._pipe.parts, self.run_log())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (resuming from a checkpoint). The rollback
        snapshot is not in it: after a resume the last good state is the one at creation."""
        guard_state.restore(self._pipe.state, self._pipe.parts, state)
