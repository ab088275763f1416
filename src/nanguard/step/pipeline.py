"""The step pipeline: what runs at each optimizer step (inside `optimizer.step()`, or between
`before_update()` and `after_update()` for a framework adapter), from the gradients to the record.

A step, in order:

1. `pre_hook` (after backward and any clipping, before the update). The LR and the
   parameters are followed; the step is measured, on the quiet lane (`watch.lane`: the
   common CPU step, no packets) or as a packet (`watch.step`). An acting policy, an armed
   replay or a cross-rank agreement reads it now: `_before_update` detects, pinpoints a
   non-finite value by replay, agrees with the other ranks and applies the policy's effects
   (`skip` takes the gradients away, so the update is a no-op).
2. The optimizer's update.
3. `post_hook` (right after the update): gives the gradients back, counts the step and reads
   what is due (at once; `read_every` steps later; one step late on a GPU under `observe`).
   Each step read is judged the same way (`_judge`): detectors (behind the quiet gate), the
   first non-finite finding, the record, the policy's post-update decision.

The pipeline's parts are made once by `step.build` (`Parts`); what it carries between steps is
`StepState`; the run log is the one writer of the record. Every entry point fails open
(`step.failopen`): an error of nanguard's own stands it down and training goes on untouched;
only the `raise` policy's `NanguardError` leaves a hook.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanguard.config import GuardConfig
from nanguard.detect import Alarm, objective
from nanguard.errors import NanguardError
from nanguard.pinpoint import xrank_log
from nanguard.pinpoint.baseline import GradBaseline
from nanguard.pinpoint.rerun import alarms_to_explain
from nanguard.policy import device_skip, wants_to_act
from nanguard.policy.act import device_skip_effects, effects_of
from nanguard.record.finding import Finding
from nanguard.record.report import Report
from nanguard.record.rows import step_signals, write_step
from nanguard.record.standdown import note_internal_error
from nanguard.recover.effects import Discard, Effect, FollowPeers, Record, Stop
from nanguard.recover.loss_after import LossAfter, loss_level
from nanguard.runtime import distributed
from nanguard.step import build
from nanguard.step.failopen import fail_open
from nanguard.step.replays import StepReplays
from nanguard.step.state import StepState
from nanguard.watch import loads, rng
from nanguard.watch.lane import LaneStep
from nanguard.watch.norms import is_dtensor
from nanguard.watch.stats import StepStats
from nanguard.watch.step import Pending

PRE_HOOK, POST_HOOK = "optimizer step pre-hook", "optimizer step post-hook"
_IN_HOOK = {PRE_HOOK: "pre", POST_HOOK: "post"}  # where a stand-down happened -> its hook


class StepPipeline:
    """One guard's step machinery (see the module docstring); the `Guard` holds one.

    Args:
        config: the settled settings (`build.settle_config`).
        model, optimizer: what is trained.
        replay: the user's `replay(batch) -> loss`, or None.
        scheduler, scaler, on_alarm, on_action, on_finding: as `Guard` takes them.
        stop: closes the run (the Guard's `close`); the `raise` policy's end calls it.
    """

    def __init__(self, config: GuardConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                 *, replay: Callable[[Any], torch.Tensor] | None, scheduler: Any, scaler: Any,
                 on_alarm: Any, on_action: Any, on_finding: Any,
                 stop: Callable[[str, str], Report]) -> None:
        self.config, self.model, self.optimizer, self.replay = config, model, optimizer, replay
        self.error: dict[str, Any] | None = None
        """Set when the pipeline stood down after an error of its own (`stand_down`)."""
        self.closed = False
        """The run is closed: every hook removed, nothing more is recorded."""
        self.exit: distributed.LockstepExit | None = None
        """What a stood-down rank still owes the other ranks' agreements."""
        self.state = StepState(step_rng=rng.capture())
        st = self.state
        st.params, st.param_names, st.param_order = build.param_table(model, optimizer)
        self.parts = build.build(self, scheduler=scheduler, scaler=scaler, on_alarm=on_alarm,
                                 on_action=on_action, on_finding=on_finding)
        self.replays = StepReplays(replay, model, self.parts, self.state)
        """Where a value showed, spikes, re-runs: the steps that need a replay."""
        self._stop_run = stop
        self.hooked = False
        self._handles: list[RemovableHandle] = []

    # -- what the parts built around it read -------------------------------------------------------

    @property
    def step(self) -> int:
        """Optimizer steps completed (the index of the step in progress)."""
        return self.state.step

    @property
    def params(self) -> list[torch.Tensor]:
        return self.state.params

    @property
    def param_names(self) -> list[str]:
        return self.state.param_names

    @property
    def spikes(self) -> list[dict[str, Any]]:
        return self.parts.log.spikes

    def record_alarm(self, alarm: Alarm) -> None:
        """An alarm raised outside the detectors (the saturation probe, replica agreement)."""
        self.parts.log.add_alarm(alarm)

    # -- hooks, and standing down ------------------------------------------------------------------

    def attach(self, hook_optimizer: bool) -> None:
        """Register the pipeline's hooks: the optimizer's step pre- and post-hooks (unless a
        framework adapter marks the step boundary itself) and the load_state_dict post-hooks
        of the model and the optimizer (loaded values are checked before the next update)."""
        opt = self.optimizer
        self.hooked = hook_optimizer
        self._handles = [
            *([opt.register_step_pre_hook(self.pre_hook),
               opt.register_step_post_hook(self.post_hook)] if hook_optimizer else []),
            self.model.register_load_state_dict_post_hook(self._on_load),
            opt.register_load_state_dict_post_hook(self._on_load),
        ]

    def detach(self) -> None:
        """Remove every hook of the pipeline and its probes, closing nothing."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.parts.saturation:
            self.parts.saturation.remove()
        if self.parts.act_probe:
            self.parts.act_probe.close()

    def stand_down(self, exc: BaseException, where: str) -> None:
        """An error inside nanguard's own code (`where`): give back what a step in flight took,
        remove every hook, record the error (`record.standdown`) and settle what this rank owes
        the others' agreements. Training goes on as it would without nanguard."""
        if self.error is not None:
            return
        st = self.state
        if st.stashed_grads is not None:  # a skip in flight: give the gradients back
            self._give_back_grads()
        st.current, st.pending = None, []
        self.detach()
        store = self.parts.store
        self.error = note_internal_error(exc, where, st.step, store.folder, store)
        self.exit = distributed.LockstepExit.after_stand_down(
            exc, self.optimizer, self._agree_device, hooked=self.hooked,
            observe=self.config.policy == "observe", cross_rank=self.parts.cross_rank,
            in_hook=_IN_HOOK.get(where), agreed=st.agreed)

    def before_update(self) -> None:
        """`Guard.before_update`: the pre-hook, or a stood-down rank's part in the others'
        agreement."""
        if self.error is None:
            self.pre_hook(self.optimizer, (), {})
        elif self.exit is not None:
            self.exit.pay("pre")

    def after_update(self) -> None:
        """`Guard.after_update`: the post-hook, or what a stood-down rank still owes."""
        if self.error is None and not self.closed:
            self.post_hook(self.optimizer, (), {})
        elif self.exit is not None:
            self.exit.pay("post")

    # -- before the update -------------------------------------------------------------------------

    @fail_open("watch")
    def watch(self, loss: torch.Tensor | float | None, batch: Any) -> None:
        """The loss and batch of the coming step (`Guard.watch`)."""
        # With a GradScaler, watch() calls without a step in between are steps the scaler
        # skipped, not micro-batches: their values must not carry into the next step.
        accumulate = self.parts.recovery.amp is None
        if loss is not None:
            t = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            if t.dim():  # a 0-dim value, as the packet stacks them (its float64 read is exact)
                t = t.reshape(-1)[0]
            if self.state.loss is not None and self.state.loss.device == t.device and accumulate:
                # Several micro-batches per step (gradient accumulation): a non-finite loss of
                # an earlier one must not be hidden by the last one (kept on the device).
                t = torch.where(torch.isfinite(self.state.loss), t, self.state.loss)
            self.state.loss = t
            self.state.watch_calls += 1
            if self.state.watch_calls > self.config.amp.stall_steps:
                # No optimizer step for a while: a GradScaler may be skipping every step.
                self.apply(self.parts.recovery.check_stall(self.state.step))
        if batch is not None:
            self.parts.batch_probe.observe(batch, accumulate=accumulate)

    @fail_open("watch")
    def watch_micro_batch(self, batch: Any) -> None:
        """Another micro-batch of the coming step (`Guard.watch_micro_batch`)."""
        self.parts.batch_probe.observe(batch, accumulate=True)

    @fail_open("note_clip_norm")
    def note_clip_norm(self, total_norm: torch.Tensor | float) -> None:
        """The script's own clip norm for the coming step (`Guard.note_clip_norm`)."""
        t = (total_norm.detach() if isinstance(total_norm, torch.Tensor)
             else torch.tensor(float(total_norm)))
        self.state.clip_norm = t.reshape(())

    def _on_load(self, loaded: Any, *_: Any) -> None:
        """`load_state_dict` post-hook of the model and the optimizer: loaded values are
        checked for finiteness before the next update, and the line that loaded them kept."""
        self.state.check_loaded = True
        if loaded is self.optimizer:  # the LR it was saved at: a resume's first step may jump
            self.parts.recovery.lr_changes.load(_lr(self.optimizer))
        self.state.load_site = loads.call_site()
        loads.note(self.state.load_site, loaded)

    @fail_open(PRE_HOOK)
    def pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step pre-hook: runs after backward and clipping, before the update. Measures
        the step (on the quiet lane where it can) and, when something must be decided before
        the update, reads and judges it there (`_before_update`)."""
        cfg, st, parts = self.config, self.state, self.parts
        recovery = parts.recovery
        st.agreed = False
        if st.clip_norm is not None:  # the script's own clipping measured it
            st.clips[st.step], st.clip_norm = st.clip_norm, None
        groups = optimizer.param_groups
        if sum(map(len, map(_PARAMS, groups))) != len(st.params):  # in C: every step
            self._sync_params()  # a group was added
        # The LR of the first group (`_lr` inline: read every step).
        lr = groups[0].get("lr") if groups else None
        lr = float(lr) if isinstance(lr, (int, float)) else None
        if recovery.skips.pending is not None:  # the step after a skipped update
            lr = recovery.skips.before_next(lr)
        if lr != recovery.lr_changes.last:  # a schedule's step; rarely a jump
            self._lr_changed(lr)
        lane = parts.lane
        if (lane is not None and not st.check_loaded and not st.pending
                and recovery.amp is None
                and (self.replay is None or parts.log.finding is not None)
                and st.params[0].device.type == "cpu"
                and (lane.every == 0 or st.step % lane.every)):
            # The quiet lane (`watch.lane`): under `observe` nothing to read before the update.
            quiet = st.current = lane.begin(st.step, lr, st.loss, st.step_rng)
            st.loss = None
            st.watch_calls = 0
            if cfg.policy != "observe":
                self._before_update(lane.read_pre(quiet), quiet, False)
            return
        loaded: list[str] = []
        flags: torch.Tensor | None = None
        if st.check_loaded:
            st.check_loaded = False
            loaded, flags = self._loaded_flags()
            for mismatch in loads.take_mismatches():  # `nanguard run`: verified at load
                # Said at load time (`report_mismatch`'s line, with why): not said twice.
                parts.log.add_alarm(loads.mismatch_alarm(st.step, mismatch),
                                    said=True)
        cur, grads = parts.steps.begin(st.step, lr, self._device, st.loss,
                                       recovery.scale_tensor(), loaded, flags, st.step_rng)
        st.current = cur
        pre = cur.pre
        st.loss = None
        st.watch_calls = 0
        replaying = self.replay is not None and parts.log.finding is None
        if cfg.policy == "observe" and not replaying and cfg.clip is None:
            if parts.cross_rank:  # observe's own agreement, every step: nothing to ask
                # here, but another rank may ask, and this one is its peer or a bystander.
                agreed = distributed.agree(False, None, self._agree_device)
                st.rerun_rank = agreed.rerun_rank
                st.agreed = True
                if st.rerun_rank is not None:
                    self.replays.cross_rerun(st.step, None, [], None)
            return
        if not replaying and cfg.clip is None and device_skip.applies(
                cfg, optimizer, grads, scaler_watched=recovery.amp is not None):
            # `skip` on the non-finite values alone, with a fused optimizer: the verdict goes to
            # the optimizer as its `found_inf` flag, no host read; recorded at the read.
            assert grads is not None
            found = device_skip.arm(optimizer, pre.slot("loss"), grads)
            pre.add("found_inf", found)
            cur.device_skip = True
            return
        # Acting policies decide before the update, and a replay needs the parameters as they
        # were before it: read the pre-step statistics now.
        self._before_update(parts.steps.read_pre(cur), cur, replaying)

    def _sync_params(self) -> None:
        """Follow the optimizer's parameters (`add_param_group` after the guard was built).
        Appending keeps every earlier parameter's index."""
        st = self.state
        st.params, st.param_names, st.param_order = build.param_table(self.model, self.optimizer)
        probe = self.parts.probe
        probe.params = st.params
        probe._update_buf = None  # reallocated for the new set at the next sample
        self.parts.store.write_params([(n, tuple(p.shape), p.numel())
                                       for n, p in zip(st.param_names, st.params, strict=True)])

    def _lr_changed(self, lr: float | None) -> None:
        """The LR differs from the last step's (or the one a loaded checkpoint carried): a
        jump up without warm-up is an `lr_jump` alarm, said at once (`policy.lr_change`)."""
        jump = self.parts.recovery.lr_changes.see(self.state.step, lr)
        if jump is None:
            return
        self.parts.log.add_alarm(jump.alarm())
        if self.state.loss_after is None or self.state.loss_after.what != "resume":
            # (a resume's own check names a jump that came with it)
            level = loss_level(s.loss for s in self.parts.log.history)
            if level is not None or jump.resumed:
                self.state.loss_after = LossAfter(level, jump.step, "jump", jump)

    def _loaded_flags(self) -> tuple[list[str], torch.Tensor | None]:
        """Before the first update (and the first after a `load_state_dict`): finiteness flags
        of every parameter, optimizer-state tensor and buffer, riding in that step's packet."""
        if self.parts.log.finding is not None:
            return [], None
        return loads.finiteness_flags(self.state.param_names, self.state.params, self.optimizer,
                                      self.parts.buffer_names, self.parts.probe.buffers)

    @property
    def _device(self) -> torch.device:
        """Where a step's packet is gathered: the first parameter's device (read each step: the
        model may be moved after the guard was built)."""
        if not self.state.params:
            return torch.device("cpu")
        p = self.state.params[0]  # `local(p)` inline: read every step
        if type(p) is not nn.Parameter and is_dtensor(p):  # (a plain parameter: no call)
            p = p.to_local()  # type: ignore[attr-defined]
        return p.device

    def _before_update(self, stats: StepStats, cur: Pending | LaneStep, replaying: bool
                       ) -> None:
        """The pre-update part of a step read before its update (`stats`, of `cur`): detect,
        pinpoint with a replay, decide and act (acting policies), recovery's own step."""
        cfg = self.config
        optimizer = self.optimizer
        alarms = self._detect(stats, "pre", cur.rng)
        if replaying and self.parts.log.finding is not None:
            assert isinstance(cur, Pending)  # the lane takes no step with a replay armed
            self.replays.refine(stats, cur)
        elif replaying and stats.amp_skipped:
            self.replays.scaler_skip(stats)
        if cfg.policy != "observe" or self.parts.cross_rank:
            want, own = (xrank_log.request(self.parts.log, stats.step)
                         if self.parts.cross_rank else (0, None))
            act = self._decide(stats, alarms, want=want)
            if self.state.rerun_rank is not None:
                self.replays.cross_rerun(stats.step, stats.loss, stats.alarms, own)
            if act:
                self._act(stats, alarms)
        if not stats.skipped:
            self.state.skips_in_row = 0
            effects = self.parts.recovery.before_update(stats)
            if effects:  # a quiet step applies nothing (no call)
                self.apply(effects)
            stats.lr = _lr(optimizer)  # the LR this update really uses (after any backoff)

    # -- after the update: one path, each step read judged the same way ----------------------------

    @fail_open(POST_HOOK)
    def post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step post-hook: runs right after the update (or where it would have been).
        One path for every step; only how the step is read differs (the reader: the quiet
        lane, or the packet path's `_read_after`), and each step read is `_judge`d."""
        st, parts = self.state, self.parts
        cur = st.current
        if cur is None:  # stood down in this very step's pre-hook
            return
        st.current, st.agreed = None, False
        parts.recovery.after_update()  # the scheduler's LR back before anything reads it
        if cur.device_skip:
            device_skip.disarm(optimizer)
        if st.stashed_grads is not None:
            self._give_back_grads()
        if type(cur) is LaneStep:  # read right after the update, in one host read
            assert parts.lane is not None
            fresh = cur.stats is None  # an acting policy read its pre-update part already
            stats = parts.lane.read(cur)
            st.step += 1
            self._judge(cur, stats, fresh)
        else:
            assert isinstance(cur, Pending), "post-step hook without a pre-step hook"
            self._read_after(cur)
        if cur.stats is not None:  # read before the update: the snapshot a rollback needs
            parts.recovery.maybe_snapshot(cur.stats)
        if parts.act_probe:  # activations on sampled steps only
            parts.act_probe.enabled = st.step % self.config.watch.activations_every == 0
        if st.step % self.config.record.rng_every == 0:  # kept: every generator
            st.step_rng = rng.capture()
            parts.store.write_rng(st.step, rng.dumps(st.step_rng))
        else:  # every step: torch's generators, what a replay of the next step draws from
            st.step_rng = rng.capture_step()

    def _read_after(self, cur: Pending) -> None:
        """The packet path's read after the update: the step joins the pending ones, read
        now (an acting policy, or every `read_every` steps) or, under `observe` on a GPU, one
        step later, once its copy to host memory is done (no stall); each is `_judge`d."""
        st = self.state
        copying = self.parts.steps.end(cur)
        st.step += 1
        st.pending.append(cur)
        if copying:
            if len(st.pending) > self.config.watch.read_every:
                older, st.pending = st.pending[:-1], st.pending[-1:]
                self.flush(older, live_last=False)
        elif cur.stats is not None or len(st.pending) >= self.config.watch.read_every:
            self.flush()

    def flush(self, pending: list[Pending] | None = None, live_last: bool = True) -> None:
        """Read `pending` steps (default: every pending step) at once, then detect and record
        them in step order. `live_last`: the newest of them is the step that just ended (its
        gradients and parameters are still those it measured)."""
        if pending is None:
            pending, self.state.pending = self.state.pending, []
        if not pending:
            return
        for p, stats, fresh in self.parts.steps.read_steps(pending, live_last):
            self._judge(p, stats, fresh)

    def _judge(self, p: Pending | LaneStep, stats: StepStats, fresh: bool) -> None:
        """Everything after the update for one step read (`stats` of `p`; `fresh`: its
        pre-update part was not judged before the update): the detectors of both phases in
        one pass under `observe` (nothing acts between them), else the post-update ones; the
        record; the policy's post-update decision (recorded first: `raise` and a rollback
        give-up stop inside `_act`)."""
        if p.device_skip:
            self._device_skipped(p, stats)
        observing = self.config.policy == "observe"
        if fresh and observing:
            alarms = self._detect(stats, "both", p.rng)
        else:
            if fresh:
                self._detect(stats, "pre", p.rng)
            alarms = self._detect(stats, "post", p.rng)
        self._record(stats, p)
        if not observing and self._decide(stats, alarms, post=True):
            self._act(stats, alarms, post=True)

    def _detect(
        self, stats: StepStats, phase: str, step_rng: dict[str, Any] | None = None
    ) -> list[Alarm]:
        """Run the detectors of `phase` (`pre`, `post`, or `both`: pre then post, for a step
        read after its update where nothing acts between the two) on `stats`; record their
        alarms on the guard and the step."""
        parts = self.parts
        alarms: list[Alarm] = []
        if phase != "post":
            effects, alarms = parts.recovery.check_amp(stats)
            if effects:
                self.apply(effects)
            if stats.amp_skipped and stats.activations:
                # The activations include the forward of a step the GradScaler skipped on an
                # expected fp16 overflow: its inf/NaN are not this step's (nor an alarm).
                stats.activations = {m: v for m, v in stats.activations.items()
                                     if math.isfinite(v)}
                stats._signals = None
        signals = stats.seal()  # final for this phase (decoding unseals): scan once
        if (parts.objective.watching and phase != "post"
                and (why := parts.objective.observe(stats)) is not None):
            parts.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        found = parts.gate.run(stats, phase, signals)  # each detector: quiet update or check
        if found:
            alarms += found
            if parts.objective.watching and any(map(objective.loss_trend, alarms)):
                alarms = self._settle_objective(stats, alarms)
        if alarms:
            for a in alarms_to_explain(alarms):  # spikes; an overflow at step 0
                self.replays.explain_spike(stats, a)
        elif phase != "post" and (every := self.config.detect.rerun_every) and (
                stats.step % every == 0):
            alarms += self.replays.sampled_rerun(stats)
        if signals:
            log = parts.log
            if log.finding is None:
                # run.db: with the step
                log.finding = Finding.from_dict(self.replays.locate(stats))
            if log.failing is None:
                log.failing = stats
        if alarms:
            if step_rng is not None:
                # Keep the RNG state at the start of an alarmed step: a replay needs it.
                parts.store.write_rng(stats.step, rng.dumps(step_rng))
            stats.alarms += alarms
            parts.log.add_alarms(alarms)
        return alarms

    def _settle_objective(self, stats: StepStats, alarms: list[Alarm]) -> list[Alarm]:
        """A loss-trend alarm while the objective is undecided: read the fingerprints kept so
        far; if they show a rollout renewed, the loss-trend alarms are off from here (this
        step's dropped, said as the `loss_trend_off` action)."""
        why = self.parts.objective.settle()
        if why is None:
            return alarms
        self.parts.log.add_action(stats.step, "loss_trend_off", objective.message(why))
        return [a for a in alarms if not objective.loss_trend(a)]

    def _record(self, stats: StepStats, p: Pending | LaneStep) -> None:
        """Keep a judged step: the loss level, the grad-norm baseline, the history up to the
        first non-finite value, run.db's row, the open episode's tick and step listeners."""
        st, parts = self.state, self.parts
        st.last_stats = stats
        log = parts.log
        finding = log.finding
        st.losses.observe(stats.loss, stats.skipped,
                          troubled=finding is not None or log.recovered_from)
        if st.loss_after is not None:
            self._check_loss_after(stats)
        signals = stats._signals if stats._signals is not None else stats.nonfinite_signals()
        if not stats.alarms and not signals:
            # Each parameter's typical grad norm on healthy steps: the baseline of a spike,
            # folded in when read (`pinpoint.baseline`).
            pending = st.grad_baseline.pending
            pending.append(stats.grad_norms)
            if len(pending) >= GradBaseline.FOLD_AT:
                st.grad_baseline.fold()
        # Keep the steps up to the first non-finite value: what led into it is the story.
        if finding is None or stats.step <= finding.step + 1:
            log.history.append(stats)
        write_step(parts.store, stats, len(st.params), self.config.watch.per_parameter,
                   clip_norm=st.clips.pop(stats.step, None) if st.clips else None)
        events = parts.events
        if events.episodes.start is not None:  # an episode is open (a quiet step: nothing)
            events.tick(stats.step, bool(stats.nonfinite_signals()))
        if events.step_listeners:
            events.step(stats.step, step_signals(stats))

    def _check_loss_after(self, stats: StepStats) -> None:
        """One of the first steps after a resume or an LR jump: its loss against the loss
        before (`recover.loss_after`); one alarm at most."""
        check = self.state.loss_after
        assert check is not None
        alarm = check.see(stats.step, stats.loss, self.parts.recovery.lr_changes.jump)
        if alarm is not None or check.done(stats.step + 1):
            self.state.loss_after = None
        if alarm is not None:  # recorded, not a detector's: the step is judged as before
            self.parts.log.add_alarm(alarm)

    def _give_back_grads(self) -> None:
        """`skip` took the gradients away for the update: give the user them back."""
        assert self.state.stashed_grads is not None
        for p, g in zip(self.state.params, self.state.stashed_grads, strict=True):
            p.grad = g
        self.state.stashed_grads = None

    # -- acting: agreement across ranks, the policy's effects --------------------------------------

    @property
    def _agree_device(self) -> torch.device:
        return self.state.params[0].device if self.state.params else torch.device("cpu")

    def _decide(self, stats: StepStats, alarms: list[Alarm], post: bool = False,
                want: int = 0) -> bool:
        """This rank's verdict, agreed with every other rank under torch.distributed: all ranks
        act in the same step, or none does (one small int32 all-reduce). `want`: this rank
        asks for a cross-rank re-run (`pinpoint.xrank`; the agreed rank, if any, is left in
        `_rerun_rank`). Under `observe` nothing acts. Raises `PeerStoodDown` when another
        rank's guard stood down (this one then does too)."""
        self.state.rerun_rank = None
        act = (self.config.policy != "observe"
               and wants_to_act(stats, alarms, self.config.acting_on, post))
        if not distributed.active():
            return act
        phase = self.replays.locate(stats)["phase"] or "" if stats.nonfinite_signals() else None
        act, bad_rank, self.state.rerun_rank = distributed.agree(act, phase, self._agree_device,
                                                            want=want)
        self.state.agreed = True
        if bad_rank is not None:
            stats.agreed_bad_rank = bad_rank
        return act

    def _act(self, stats: StepStats, alarms: list[Alarm], post: bool = False) -> None:
        """Apply what the policy stage decides for this step (see `nanguard.policy`)."""
        d = self.parts.policy.decide(stats, alarms, post=post, skips_in_row=self.state.skips_in_row)
        effects, self.state.skips_in_row = effects_of(
            d, stats, recovery=self.parts.recovery, post=post, skips_in_row=self.state.skips_in_row,
            limit=self.config.recover.max_consecutive_skips)
        self.apply(effects)

    def _device_skipped(self, p: Pending | LaneStep, stats: StepStats) -> None:
        """Record what the fused optimizer did with the `found_inf` flag of step `p` (read a
        step late on a GPU): a discarded update is a `skip` action; too many in a row stop the
        run, as the host-side `skip` does."""
        if not p.found_inf:
            self.state.skips_in_row = 0
            return
        effects, self.state.skips_in_row = device_skip_effects(
            stats, skips_in_row=self.state.skips_in_row,
            limit=self.config.recover.max_consecutive_skips)
        self.parts.recovery.discarded(stats, late=stats.step != self.state.step - 1)
        self.apply(effects)

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`recover.effects`): record an
        action or an alarm, discard the coming update, let coupled guards follow a rollback,
        or stop (closes the run and raises `NanguardError`; nothing after it is applied)."""
        for e in effects:
            if isinstance(e, Record):
                self.parts.log.add_action(e.step, e.action, e.detail)
            elif isinstance(e, Alarm):
                self.parts.log.add_alarm(e)
            elif isinstance(e, Discard):
                self._discard_update(e.stats)
            elif isinstance(e, FollowPeers):
                self.parts.recovery.follow_peers(e.step, e.optimizer, e.factor)
            elif isinstance(e, Stop):
                self._stop(e.stats, e.why)

    def _discard_update(self, stats: StepStats) -> None:
        """Make the coming `optimizer.step()` a no-op: optimizers leave a parameter whose .grad
        is None untouched (no update, no state change, no step-counter increment). The
        post-hook puts the gradients back."""
        if self.state.stashed_grads is None:
            self.state.stashed_grads = [p.grad for p in self.state.params]
            for p in self.state.params:
                p.grad = None
        stats.skipped = True
        self.parts.recovery.discarded(stats, late=False)

    def _stop(self, stats: StepStats, why: str) -> None:
        """Close the run and raise NanguardError with the report (the `raise` policy's end)."""
        if self.state.current is not None:
            self._record(stats, self.state.current)
            self.state.current = None
        message = f"nanguard stopped training at step {stats.step}: {why}"
        report = self._stop_run("stopped", message)
        raise NanguardError(message, report)

    # -- the end of the run ------------------------------------------------------------------------

    @fail_open("close")
    def finish(self) -> None:
        """At close: read every pending step, check what was handed to `watch` after the last
        step, and let the store write its last batch (a writer failure: degraded, not lost)."""
        self.flush()
        self._check_leftover()
        self.parts.store.flush()

    def _check_leftover(self) -> None:
        """At close: a loss or batch handed to `watch` after the last optimizer step (the run
        died in its first iteration, or before the next step) is checked too, so a NaN that
        never reached an optimizer step is not lost. One host read, only when there is one."""
        if self.parts.log.finding is not None:
            return
        stats = self.parts.steps.leftover(self.state.step, self._device, self.state.loss)
        self.state.loss = None
        if stats is not None and (stats.nonfinite_signals() or stats.nonfinite_samples):
            found = self.replays.locate(stats)
            found["signals"] = found["signals"] or ["data"]
            self.parts.log.set_finding(found, failing=stats)

def _lr(optimizer: torch.optim.Optimizer) -> float | None:
    lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
    return float(lr) if isinstance(lr, (int, float)) else None


_PARAMS = operator.itemgetter("params")
