"""The Guard's step path: what runs inside `optimizer.step()` (or between `before_update()` and
`after_update()` for a framework adapter).

The pre-hook runs after backward (and any clipping), before the update: it gathers the step's
packet and, when a policy acts before the update or a replay is armed, reads it, detects,
pinpoints and applies the policy's effects. The post-hook runs right after the update: it
gives back gradients a `skip` took away, reads pending steps (at once, or `read_every` steps
later, or one step late on a GPU under `observe`), detects, records and acts on what the
update did. Errors of nanguard's own stand it down (`Guard.stand_down`); only the `raise`
policy's `NanguardError` leaves a hook.

`StepPath` is the part of `Guard` that holds these methods; `Guard` sets every attribute
declared below in its constructor. It imports nothing of the Guard's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nanguard.config import GuardConfig
from nanguard.detect import Alarm, bad_batch, objective
from nanguard.detect.detectors import Detector
from nanguard.detect.gate import QuietGate
from nanguard.detect.objective import Objective
from nanguard.errors import NanguardError
from nanguard.pinpoint import live as pinpoint
from nanguard.pinpoint import xrank, xrank_log
from nanguard.pinpoint.baseline import GradBaseline
from nanguard.pinpoint.rerun import alarms_to_explain
from nanguard.policy import Policy, device_skip, wants_to_act
from nanguard.policy.act import device_skip_effects, effects_of
from nanguard.record.events import Events
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.record.rows import step_signals, write_step
from nanguard.record.runlog import RunLog
from nanguard.record.store import NullStore
from nanguard.recover.effects import Discard, Effect, FollowPeers, Record, Stop
from nanguard.recover.loss_after import LossAfter, loss_level
from nanguard.recover.recovery import Recovery
from nanguard.recover.verdict import LossWatch
from nanguard.runtime import distributed
from nanguard.watch import loads, rng
from nanguard.watch.activations import ActivationProbe
from nanguard.watch.batch import BatchProbe
from nanguard.watch.lane import LaneStep, QuietLane
from nanguard.watch.norms import DTENSOR
from nanguard.watch.stats import StepProbe, StepStats
from nanguard.watch.step import Pending, StepWatch


class StepPath:
    """The optimizer-step hooks of a `Guard` and what they call (see the module docstring)."""

    config: GuardConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    replay: Callable[[Any], torch.Tensor] | None
    store: NullStore
    events: Events
    log: RunLog
    recovery: Recovery
    policy: Policy
    steps: StepWatch
    probe: StepProbe
    act_probe: ActivationProbe | None
    batch_probe: BatchProbe
    params: list[torch.Tensor]
    param_names: list[str]
    buffer_names: list[str]
    step: int
    _param_order: list[int]
    _by_phase: dict[str, list[Detector]]
    _rerun_every: int
    _gate: QuietGate
    _objective: Objective
    _current: Pending | LaneStep | None
    _pending: list[Pending]
    _stashed_grads: list[torch.Tensor | None] | None
    _step_rng: dict[str, Any]
    _loss: torch.Tensor | None
    _clip_norm: torch.Tensor | None
    """The script's clip norm for the coming step (`Guard.note_clip_norm`)."""
    _clips: dict[int, torch.Tensor]
    """Clip norms by the step they were given for, until that step is recorded (read a step
    late on a GPU)."""
    _last_stats: StepStats | None
    _grad_baseline: GradBaseline
    _losses: LossWatch
    _loss_after: LossAfter | None
    """After `load_state_dict`: the loss at save, for the first steps after the resume."""
    _skips_in_row: int
    _watch_calls: int
    _check_loaded: bool
    _load_site: str | None
    _in_hook: str | None
    _agreed: bool
    _rerun_rank: int | None
    _cross_rank: bool
    _lane: QuietLane | None = None
    """The quiet lane (`watch.lane`), or None where this guard never takes it; built at the
    first step (`_lane_known`)."""
    _lane_known: bool = False

    def stand_down(self, exc: BaseException, where: str) -> None:
        raise NotImplementedError  # the Guard's

    def close(self, ended: str | None = None, error: str | None = None) -> Report:
        raise NotImplementedError  # the Guard's

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
                self.apply(self.recovery.check_stall(self.step))
        if batch is not None:
            self.batch_probe.observe(batch, accumulate=accumulate)

    def _on_load(self, loaded: Any, *_: Any) -> None:
        """`load_state_dict` post-hook of the model and the optimizer: loaded values are
        checked for finiteness before the next update, and the line that loaded them kept."""
        self._check_loaded = True
        if loaded is self.optimizer:  # the LR it was saved at: a resume's first step may jump
            self.recovery.lr_changes.load(_lr(self.optimizer))
        self._load_site = loads.call_site()
        loads.note(self._load_site, loaded)

    def _lr_changed(self, lr: float | None) -> None:
        """The LR differs from the last step's (or the one a loaded checkpoint carried): a
        jump up without warm-up is an `lr_jump` alarm, said at once (`policy.lr_change`)."""
        jump = self.recovery.lr_changes.see(self.step, lr)
        if jump is None:
            return
        self.log.add_alarm(jump.alarm())
        if self._loss_after is None or self._loss_after.what != "resume":
            # (a resume's own check names a jump that came with it)
            level = loss_level(s.loss for s in self.log.history)
            if level is not None or jump.resumed:
                self._loss_after = LossAfter(level, jump.step, "jump", jump)

    def _check_loss_after(self, stats: StepStats) -> None:
        """One of the first steps after a resume or an LR jump: its loss against the loss
        before (`recover.loss_after`); one alarm at most."""
        check = self._loss_after
        assert check is not None
        alarm = check.see(stats.step, stats.loss, self.recovery.lr_changes.jump)
        if alarm is not None or check.done(stats.step + 1):
            self._loss_after = None
        if alarm is not None:  # recorded, not a detector's: the step is judged as before
            self.log.add_alarm(alarm)

    def _loaded_finding(self, step: int, names: list[str], flags: list[float]) -> None:
        """The first non-finite finding for loaded state (phase `checkpoint`)."""
        if self.log.finding is not None:
            return
        found = loads.finding(step, names, flags, self._load_site or loads.last_site())
        if found is not None:
            found["rank"] = distributed.rank()
            self.log.set_finding(found, announce=True)  # said at once: where it came from

    def _check_leftover(self) -> None:
        """At close: a loss or batch handed to `watch` after the last optimizer step (the run
        died in its first iteration, or before the next step) is checked too, so a NaN that
        never reached an optimizer step is not lost. One host read, only when there is one."""
        if self.log.finding is not None:
            return
        stats = self.steps.leftover(self.step, self._device, self._loss)
        self._loss = None
        if stats is not None and (stats.nonfinite_signals() or stats.nonfinite_samples):
            found = self._locate(stats)
            found["signals"] = found["signals"] or ["data"]
            self.log.set_finding(found, failing=stats)

    @property
    def _device(self) -> torch.device:
        """Where a step's packet is gathered: the first parameter's device (read each step: the
        model may be moved after the guard was built)."""
        if not self.params:
            return torch.device("cpu")
        p = self.params[0]  # `local(p)` inline: read every step
        if DTENSOR is not None and isinstance(p, DTENSOR):
            p = p.to_local()  # type: ignore[attr-defined]
        return p.device

    def _sync_params(self) -> bool:
        """Follow the optimizer's parameters (`add_param_group` after the guard was built).
        Appending keeps every earlier parameter's index. Returns whether they changed."""
        n = sum(map(len, map(_PARAMS, self.optimizer.param_groups)))  # in C: every step
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
        if self.log.finding is not None:
            return [], None
        return loads.finiteness_flags(self.param_names, self.params, self.optimizer,
                                      self.buffer_names, self.probe.buffers)

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
        cur = self._current
        if cur is None:  # stood down in the pre-hook of this very step
            return
        self._in_hook, self._agreed = "post", False
        try:
            if type(cur) is LaneStep:
                self._lane_post(cur)
            else:
                self._post()
        except NanguardError:
            raise
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self.stand_down(exc, "optimizer step post-hook")
        finally:
            self._in_hook = None

    def _make_lane(self) -> QuietLane | None:
        """The quiet lane, where this guard's configuration lets a step take it (see
        `watch.lane`: no clipping, no cross-rank agreement, no activation watch, a read every
        step, local parameters, no `skip` the device could decide); per step `_pre` checks
        the rest."""
        cfg = self.config
        if (cfg.clip is not None or self._cross_rank or self.act_probe is not None
                or cfg.watch.read_every != 1 or not self.params
                or (cfg.policy == "skip" and set(cfg.acting_on) == {"nonfinite"}
                    and device_skip.supports(self.optimizer))
                or (DTENSOR is not None and any(isinstance(p, DTENSOR) for p in self.params))):
            return None
        return QuietLane(self.steps, cfg.watch.update_ratio_every)

    def _pre(self, optimizer: torch.optim.Optimizer) -> None:
        cfg = self.config
        if self._clip_norm is not None:  # the script's own clipping measured it
            self._clips[self.step], self._clip_norm = self._clip_norm, None
        if self._sync_params():
            self._write_params()
        if not self._lane_known:
            self._lane, self._lane_known = self._make_lane(), True
        lr = _lr(optimizer)
        if self.recovery.skips.pending is not None:  # the step after a skipped update
            lr = self.recovery.skips.before_next(lr)
        if lr != self.recovery.lr_changes.last:  # a schedule's step; rarely a jump
            self._lr_changed(lr)
        lane = self._lane
        if (lane is not None and not self._check_loaded and not self._pending
                and self.recovery.amp is None
                and (self.replay is None or self.log.finding is not None)
                and self.params[0].device.type == "cpu"
                and (lane.every == 0 or self.step % lane.every)):
            # The quiet lane (`watch.lane`): under `observe` nothing to read before the update.
            cur = self._current = lane.begin(self.step, lr, self._loss,
                                             self._step_rng)
            self._loss = None
            self._watch_calls = 0
            if cfg.policy != "observe":
                self._before_update(lane.read_pre(cur), cur, False)
            return
        loaded: list[str] = []
        flags: torch.Tensor | None = None
        if self._check_loaded:
            self._check_loaded = False
            loaded, flags = self._loaded_flags()
            for mismatch in loads.take_mismatches():  # `nanguard run`: verified at load
                # Said at load time (`report_mismatch`'s line, with why): not said twice.
                self.log.add_alarm(loads.mismatch_alarm(self.step, mismatch), said=True)
        self._current, grads = self.steps.begin(
            self.step, lr, self._device, self._loss, self.recovery.scale_tensor(),
            loaded, flags, self._step_rng)
        pre = self._current.pre
        self._loss = None
        self._watch_calls = 0
        replaying = self.replay is not None and self.log.finding is None
        if cfg.policy == "observe" and not replaying and cfg.clip is None:
            if self._cross_rank:  # observe's own agreement, every step: nothing to ask here,
                # but another rank may ask, and this one is then its peer or a bystander.
                self._rerun_rank = distributed.agree(False, None, self._agree_device).rerun_rank
                self._agreed = True
                if self._rerun_rank is not None:
                    self._cross_rerun(self.step, None, [], None)
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
        self._before_update(self.steps.read_pre(self._current), self._current, replaying)

    def _before_update(self, stats: StepStats, cur: Pending | LaneStep, replaying: bool
                       ) -> None:
        """The pre-update part of a step read before its update (`stats`, of `cur`): detect,
        pinpoint with a replay, decide and act (acting policies), recovery's own step."""
        cfg = self.config
        optimizer = self.optimizer
        alarms = self._detect(stats, "pre", cur.rng)
        if replaying and self.log.finding is not None:
            assert isinstance(cur, Pending)  # the lane takes no step with a replay armed
            self._pinpoint(stats, cur)
        elif replaying and stats.amp_skipped:
            self._check_scaler_skip(stats)
        if cfg.policy != "observe" or self._cross_rank:
            want, own = xrank_log.request(self.log, stats.step) if self._cross_rank else (0, None)
            act = self._decide(stats, alarms, want=want)
            if self._rerun_rank is not None:
                self._cross_rerun(stats.step, stats.loss, stats.alarms, own)
            if act:
                self._act(stats, alarms)
        if not stats.skipped:
            self._skips_in_row = 0
            effects = self.recovery.before_update(stats)
            if effects:  # a quiet step applies nothing (no call)
                self.apply(effects)
            stats.lr = _lr(optimizer)  # the LR this update really uses (after any backoff)

    def _check_scaler_skip(self, stats: StepStats) -> None:
        """The GradScaler skipped the step before this one: with `replay`, was it an fp16
        overflow or a real fault it hid? (`pinpoint.live.scaler_skip_finding`)."""
        skipped, self.batch_probe.skipped = self.batch_probe.skipped, []
        if self.replay is None or self.log.finding is not None:
            return
        found = pinpoint.scaler_skip_finding(
            stats, self.replay, model=self.model, params=self.params, skipped=skipped,
            act_probe=self.act_probe, rank=distributed.rank())
        if found is not None:
            self.log.set_finding(found, failing=stats, announce=True)

    def _pinpoint(self, stats: StepStats, cur: Pending) -> None:
        """Refine the first non-finite finding by replaying this step before its update."""
        assert self.replay is not None and self.log.finding is not None
        update, news = pinpoint.refine_by_replay(
            self.log.finding, stats, self.replay, model=self.model, params=self.params,
            batches=self.batch_probe, act_probe=self.act_probe, step_rng=cur.rng)
        if update:
            self.log.refine_finding(update, write=news, announce=news)

    def _post(self) -> None:
        cur = self._current
        assert isinstance(cur, Pending), "post-step hook without a pre-step hook"
        self._current = None
        self.recovery.after_update()  # the scheduler's LR back before anything reads it
        if cur.device_skip:
            device_skip.disarm(self.optimizer)
        if self._stashed_grads is not None:
            self._give_back_grads()
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
        self._next_rng()

    def _next_rng(self) -> None:
        """The RNG state at the start of the next step (kept for a replay of it)."""
        if self.step % self.config.record.rng_every == 0:  # kept: every generator
            self._step_rng = rng.capture()
            self.store.write_rng(self.step, rng.dumps(self._step_rng))
        else:  # every step: torch's generators, what a replay of the step draws from
            self._step_rng = rng.capture_step()

    def _lane_post(self, cur: LaneStep) -> None:
        """`_post` for a step in the quiet lane (`watch.lane`), as `_post` and `_flush` do it
        for such a step: read right after the update; under `observe` both phases' detectors
        at once, else the post-update ones, the policy's post-update decision and recovery's
        snapshot; recorded."""
        assert self._lane is not None
        self._current = None
        self.recovery.after_update()
        if self._stashed_grads is not None:
            self._give_back_grads()
        acted = cur.stats is not None  # read before the update (an acting policy)
        stats = self._lane.read(cur)
        self.step += 1
        if not acted:
            self._detect(stats, "both", cur.rng)
            self._record(stats, cur)
        else:
            alarms = self._detect(stats, "post", cur.rng)
            self._record(stats, cur)  # before acting: `raise` and a rollback give-up stop
            if self._decide(stats, alarms, post=True):
                self._act(stats, alarms, post=True)
            self.recovery.maybe_snapshot(stats)
        self._next_rng()

    def _give_back_grads(self) -> None:
        """`skip` took the gradients away for the update: give the user them back."""
        assert self._stashed_grads is not None
        for p, g in zip(self.params, self._stashed_grads, strict=True):
            p.grad = g
        self._stashed_grads = None

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
            effects, alarms = self.recovery.check_amp(stats)
            if effects:
                self.apply(effects)
            if stats.amp_skipped and stats.activations:
                # The activations include the forward of a step the GradScaler skipped on an
                # expected fp16 overflow: its inf/NaN are not this step's (nor an alarm).
                stats.activations = {m: v for m, v in stats.activations.items()
                                     if math.isfinite(v)}
                stats._signals = None
        signals = stats.seal()  # final for this phase (decoding unseals): scan once
        if (self._objective.watching and phase != "post"
                and (why := self._objective.observe(stats)) is not None):
            self.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        found = self._gate.run(stats, phase, signals)  # each detector: quiet lane or check
        if found:
            alarms += found
            if self._objective.watching and any(map(objective.loss_trend, alarms)):
                alarms = self._settle_objective(stats, alarms)
        if alarms:
            for a in alarms_to_explain(alarms):  # spikes; an overflow at step 0
                self._explain_spike(stats, a)
        elif phase != "post" and self._rerun_every and stats.step % self._rerun_every == 0:
            alarms += self._sampled_rerun(stats)
        if signals:
            log = self.log
            if log.finding is None:
                log.finding = Finding.from_dict(self._locate(stats))  # run.db: with the step
            if log.failing is None:
                log.failing = stats
        if alarms:
            if step_rng is not None:
                # Keep the RNG state at the start of an alarmed step: a replay needs it.
                self.store.write_rng(stats.step, rng.dumps(step_rng))
            stats.alarms += alarms
            self.log.add_alarms(alarms)
        return alarms

    def _settle_objective(self, stats: StepStats, alarms: list[Alarm]) -> list[Alarm]:
        """A loss-trend alarm while the objective is undecided: read the fingerprints kept so
        far; if they show a rollout renewed, the loss-trend alarms are off from here (this
        step's dropped, said as the `loss_trend_off` action)."""
        why = self._objective.settle()
        if why is None:
            return alarms
        self.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        return [a for a in alarms if not objective.loss_trend(a)]

    @property
    def _agree_device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _crosses_ranks(self) -> bool:
        """Whether the ranks re-run an alarmed rank's batch on a peer (`pinpoint.xrank`): with
        a replay under a process group, for a DDP model (replicas: the peer holds the same
        parameters; a sharded or per-rank model has no peer that could compute the same step,
        and FSDP's forward gathers across all ranks). The same on every rank (none may skip
        the agreement); decided once, when the Guard is built (`_cross_rank`: no call on the
        quiet path)."""
        return (self.replay is not None and self.config.detect.cross_rank_rerun
                and isinstance(self.model, DistributedDataParallel) and distributed.active())

    def _decide(self, stats: StepStats, alarms: list[Alarm], post: bool = False,
                want: int = 0) -> bool:
        """This rank's verdict, agreed with every other rank under torch.distributed: all ranks
        act in the same step, or none does (one small int32 all-reduce). `want`: this rank
        asks for a cross-rank re-run (`pinpoint.xrank`; the agreed rank, if any, is left in
        `_rerun_rank`). Under `observe` nothing acts. Raises `PeerStoodDown` when another
        rank's guard stood down (this one then does too)."""
        self._rerun_rank = None
        act = (self.config.policy != "observe"
               and wants_to_act(stats, alarms, self.config.acting_on, post))
        if not distributed.active():
            return act
        phase = self._locate(stats)["phase"] or "" if stats.nonfinite_signals() else None
        act, bad_rank, self._rerun_rank = distributed.agree(act, phase, self._agree_device,
                                                            want=want)
        self._agreed = True
        if bad_rank is not None:
            stats.agreed_bad_rank = bad_rank
        return act

    def _cross_rerun(self, step: int, loss: float | None, alarms: list[Alarm],
                     own: dict[str, Any] | None) -> None:
        """Every rank, after an agreement that named `_rerun_rank`: re-run that rank's batch
        there and on a peer, and record the verdict of `step` (`pinpoint.xrank`); `loss`,
        `own`: the step's loss and this rank's own re-run verdict (the suspect's count).
        A rank that cannot take part any more raises out of here (a timeout: a peer died)
        and stands down."""
        assert self.replay is not None and self._rerun_rank is not None
        cur = self._current
        verdict = xrank.cross_rerun(
            self.replay, suspect=self._rerun_rank, model=self.model, params=self.params,
            batch=self.batch_probe.last, step_rng=cur.rng if cur is not None else None,
            loss=loss, own=own)
        xrank_log.record(self.log, step, alarms, verdict)

    def _act(self, stats: StepStats, alarms: list[Alarm], post: bool = False) -> None:
        """Apply what the policy stage decides for this step (see `nanguard.policy`)."""
        d = self.policy.decide(stats, alarms, post=post, skips_in_row=self._skips_in_row)
        effects, self._skips_in_row = effects_of(
            d, stats, recovery=self.recovery, post=post, skips_in_row=self._skips_in_row,
            limit=self.config.recover.max_consecutive_skips)
        self.apply(effects)

    def _device_skipped(self, p: Pending, stats: StepStats) -> None:
        """Record what the fused optimizer did with the `found_inf` flag of step `p` (read a
        step late on a GPU): a discarded update is a `skip` action; too many in a row stop the
        run, as the host-side `skip` does."""
        if not p.found_inf:
            self._skips_in_row = 0
            return
        effects, self._skips_in_row = device_skip_effects(
            stats, skips_in_row=self._skips_in_row,
            limit=self.config.recover.max_consecutive_skips)
        self.recovery.discarded(stats, late=stats.step != self.step - 1)
        self.apply(effects)

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`recover.effects`): record an
        action or an alarm, discard the coming update, let coupled guards follow a rollback,
        or stop (closes the run and raises `NanguardError`; nothing after it is applied)."""
        for e in effects:
            if isinstance(e, Record):
                self.log.add_action(e.step, e.action, e.detail)
            elif isinstance(e, Alarm):
                self.log.add_alarm(e)
            elif isinstance(e, Discard):
                self._discard_update(e.stats)
            elif isinstance(e, FollowPeers):
                self.recovery.follow_peers(e.step, e.optimizer, e.factor)
            elif isinstance(e, Stop):
                self._stop(e.stats, e.why)

    def _discard_update(self, stats: StepStats) -> None:
        """Make the coming `optimizer.step()` a no-op: optimizers leave a parameter whose .grad
        is None untouched (no update, no state change, no step-counter increment). The
        post-hook puts the gradients back."""
        if self._stashed_grads is None:
            self._stashed_grads = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None
        stats.skipped = True
        self.recovery.discarded(stats, late=False)

    def _stop(self, stats: StepStats, why: str) -> None:
        """Close the run and raise NanguardError with the report (the `raise` policy's end)."""
        if self._current is not None:
            self._record(stats, self._current)
            self._current = None
        message = f"nanguard stopped training at step {stats.step}: {why}"
        report = self.close("stopped", message)
        raise NanguardError(message, report)

    def _locate(self, stats: StepStats) -> dict[str, Any]:
        return pinpoint.locate_step(stats, self.param_names, distributed.rank(),
                                    order=self._param_order, buffer_names=self.buffer_names)

    def _explain_spike(self, stats: StepStats, alarm: Alarm) -> None:
        """Which layers carry a spike and, seen before its update with `replay`, which samples
        cause it and whether it re-runs the same (`pinpoint.live.explain_spike`)."""
        cur = self._current
        before_update = cur is not None and cur.stats is stats
        found = pinpoint.explain_spike(
            stats, replay=self.replay if before_update else None, model=self.model,
            params=self.params, param_names=self.param_names, batches=self.batch_probe,
            act_probe=self.act_probe, baseline=self._grad_baseline.values(),
            step_rng=cur.rng if before_update and cur else None,
            amp=self.recovery.amp is not None)
        if alarm.kind != "spike":  # an overflow the spike detector could not see (step 0)
            found["alarm"] = alarm.kind
        found.update(bad_batch.spike_entry(stats, alarm, found))
        self.log.add_spike(stats.step, found)
        alarm.message += pinpoint.spike_note(found)

    def _sampled_rerun(self, stats: StepStats) -> list[Alarm]:
        """`DetectConfig.rerun_every`: re-run this quiet step before its update and compare
        bit for bit; a `rerun_mismatch` alarm when it differs (its verdict is kept with the
        spikes' ones, where the diagnosis reads re-run verdicts)."""
        cur = self._current
        if self.replay is None or cur is None or cur.stats is not stats:
            return []  # no forward to re-run, or the step was read after its update
        found = pinpoint.rerun(stats, self.replay, model=self.model, params=self.params,
                               batches=self.batch_probe, act_probe=self.act_probe,
                               step_rng=cur.rng, amp=self.recovery.amp is not None)
        if found.get("verdict") != "transient":
            return []
        self.log.add_spike(stats.step, {"layers": [], "samples": [], "rerun": found,
                                        "alarm": "rerun_mismatch"})
        return [Alarm(step=stats.step, kind="rerun_mismatch", signal="rerun",
                      value=float(found.get("differing") or 0),
                      message=f"a sampled re-run of step {stats.step} differs from the step "
                      f"itself: {found.get('why')}")]

    def _record(self, stats: StepStats, p: Pending | LaneStep) -> None:
        self._last_stats = stats
        log = self.log
        finding = log.finding
        self._losses.observe(stats.loss, stats.skipped,
                             troubled=finding is not None or log.recovered_from)
        if self._loss_after is not None:
            self._check_loss_after(stats)
        signals = stats._signals if stats._signals is not None else stats.nonfinite_signals()
        if not stats.alarms and not signals:
            # Each parameter's typical grad norm on healthy steps: the baseline of a spike,
            # folded in when read (`pinpoint.baseline`).
            pending = self._grad_baseline.pending
            pending.append(stats.grad_norms)
            if len(pending) >= GradBaseline.FOLD_AT:
                self._grad_baseline.fold()
        # Keep the steps up to the first non-finite value: what led into it is the story.
        if finding is None or stats.step <= finding.step + 1:
            log.history.append(stats)
        write_step(self.store, stats, len(self.params), self.config.watch.per_parameter,
                   clip_norm=self._clips.pop(stats.step, None) if self._clips else None)
        events = self.events
        if events.episodes.start is not None:  # an episode is open (a quiet step: nothing)
            events.tick(stats.step, bool(stats.nonfinite_signals()))
        if events.step_listeners:
            events.step(stats.step, step_signals(stats))


def _lr(optimizer: torch.optim.Optimizer) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


_PARAMS = operator.itemgetter("params")
