"""The step pipeline: what runs at each optimizer step (inside `optimizer.step()`, or between
`before_update()` and `after_update()` for a framework adapter), from the gradients to the record.

A step, in order:

1. `pre_hook` (after backward and any clipping, before the update). The LR and the
   parameters are followed (`step.before`); the step is measured, on the quiet lane
   (`watch.lane`: the common CPU step, no packets) or as a packet (`watch.step`). An acting
   policy, an armed replay or a cross-rank agreement reads it now and
   `Judge.before_update` (`step.judging`) detects, pinpoints a non-finite value by replay,
   agrees with the other ranks and applies the policy's effects (`step.acting`; `skip`
   takes the gradients away, so the update is a no-op).
2. The optimizer's update.
3. `post_hook` (right after the update): gives the gradients back, counts the step and reads
   what is due (at once; `read_every` steps later; one step late on a GPU under `observe`).
   Each step read is judged the same way (`Judge.after_update`): detectors (behind the
   quiet gate), the first non-finite finding, the record (`step.keeping`), the policy's
   post-update decision.

The pipeline's parts are made once by `step.build` (`Parts`); what it carries between steps is
`StepState`, handed explicitly to the modules above (none holds state of its own); the run log is
the one writer of the record. Every entry point fails open (`step.failopen`): an error of
nanguard's own stands it down and training goes on untouched; only the `raise` policy's
`NanguardError` leaves a hook. What a step calls is settled when the pipeline is built: a part with
nothing to do under this configuration (recovery without a scaler, a rollback or `heal`; a detector
with no episode open) is left out of the step, not called to return.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanguard.config import GuardConfig
from nanguard.detect import Alarm
from nanguard.policy import device_skip
from nanguard.record.report import Report
from nanguard.record.standdown import note_internal_error
from nanguard.recover.effects import Effect
from nanguard.runtime import distributed
from nanguard.runtime.hooks import ModuleHook
from nanguard.step import before, build
from nanguard.step.acting import Acting, agree_device
from nanguard.step.failopen import contain, fail_open
from nanguard.step.judging import Judge, lr_of
from nanguard.step.replays import StepReplays
from nanguard.step.state import StepState
from nanguard.watch import loads, rng
from nanguard.watch.lane import LaneStep
from nanguard.watch.norms import is_dtensor
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
        self.acting = Acting(config, self.state, self.parts, self.replays, stop)
        """The cross-rank agreement, the policy's decisions and every effect applied."""
        self.judge = Judge(config, optimizer, self.state, self.parts, self.replays, self.acting)
        """Each step read judged: detectors, the finding, the record, the decisions."""
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

    def apply(self, effects: list[Effect]) -> None:
        """Apply what a policy or recovery decided, in order (`Acting.apply`): recovery's link
        calls it for a coupled guard's rollback, `Guard.apply` for the user's."""
        self.acting.apply(effects)

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
            self.model.register_load_state_dict_post_hook(ModuleHook(self._on_load)),
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
            self.acting.give_back_grads()
        st.current, st.pending = None, []
        self.detach()
        store = self.parts.store
        self.error = note_internal_error(exc, where, st.step, store.folder, store)
        self.exit = distributed.LockstepExit.after_stand_down(
            exc, self.optimizer, agree_device(self.state), hooked=self.hooked,
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

    def watch(self, loss: torch.Tensor | float | None, batch: Any) -> None:
        """The loss and batch of the coming step (`Guard.watch`). Fails open (`contain`)."""
        if self.error is not None:
            return
        try:
            # With a GradScaler, watch() calls without a step in between are steps the scaler
            # skipped, not micro-batches: their values must not carry into the next step.
            amp = self.parts.recovery.amp
            st = self.state
            if loss is not None:
                t = (loss.detach() if isinstance(loss, torch.Tensor)
                     else torch.tensor(float(loss)))
                if t.dim():  # 0-dim, as the packet stacks them (its float64 read is exact)
                    t = t.reshape(-1)[0]
                if st.loss is not None and st.loss.device == t.device and amp is None:
                    # Several micro-batches per step (gradient accumulation): a non-finite
                    # loss of an earlier one must not be hidden by the last (on the device).
                    t = torch.where(torch.isfinite(st.loss), t, st.loss)
                st.loss = t
                st.watch_calls += 1
                if st.watch_calls > self.config.amp.stall_steps and amp is not None:
                    # No optimizer step for a while: the GradScaler may be skipping each step.
                    self.acting.apply(amp.check_stall(st.step))
            if batch is not None:
                self.parts.batch_probe.observe(batch, accumulate=amp is None)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            contain(self, exc, "watch")

    @fail_open("watch")
    def watch_micro_batch(self, batch: Any) -> None:
        """Another micro-batch of the coming step (`Guard.watch_micro_batch`)."""
        self.parts.batch_probe.observe(batch, accumulate=True)

    @fail_open("note_clip_norm")
    def note_clip_norm(self, total_norm: torch.Tensor | float) -> None:
        """The script's own clip norm for the coming step (`Guard.note_clip_norm`)."""
        if isinstance(total_norm, torch.Tensor):
            if is_dtensor(total_norm):  # its value needs a collective: not in a hook
                return
            t = total_norm.detach()
        else:
            t = torch.tensor(float(total_norm))
        self.state.clip_norm = t.reshape(())

    def _on_load(self, loaded: Any, *_: Any) -> None:
        """`load_state_dict` post-hook of the model and the optimizer: loaded values are
        checked for finiteness before the next update, and the line that loaded them kept."""
        self.state.check_loaded = True
        if loaded is self.optimizer:  # the LR it was saved at: a resume's first step may jump
            self.parts.recovery.lr_changes.load(lr_of(self.optimizer))
        self.state.load_site = loads.call_site()
        loads.note(self.state.load_site, loaded)

    def pre_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step pre-hook: runs after backward and clipping, before the update. Measures
        the step (on the quiet lane where it can, else as a packet: `_pre_packet`) and, when
        something must be decided before the update, reads and judges it there
        (`Judge.before_update`). Fails open (`contain`, written here: a wrapper would be one
        more call every step)."""
        if self.error is not None:
            return
        try:
            st, parts = self.state, self.parts
            recovery = parts.recovery
            st.agreed = False
            # The script's own clip's measured total, read with the step's values.
            clip, st.clip_norm = st.clip_norm, None
            groups = optimizer.param_groups
            if sum(map(len, map(_PARAMS, groups))) != len(st.params):  # in C: every step
                before.follow_params(st, parts, self.model, optimizer)  # a group added
            # The LR of the first group (`judging.lr_of` inline: read every step).
            lr = groups[0].get("lr") if groups else None
            lr = float(lr) if isinstance(lr, (int, float)) else None
            if recovery.skips.pending is not None:  # the step after a skipped update
                lr = recovery.skips.before_next(lr)
            if lr != recovery.lr_changes.last:  # a schedule's step; rarely a jump
                before.lr_changed(st, parts, lr)
            lane = parts.lane
            if (lane is None or st.check_loaded or st.pending or recovery.amp is not None
                    or (self.replay is not None and parts.log.finding is None)
                    or st.params[0].device.type != "cpu"
                    or (lane.every and not st.step % lane.every)):
                self._pre_packet(optimizer, lr, clip)
                return
            # The quiet lane (`watch.lane`): under `observe` nothing to read before the update.
            quiet = st.current = lane.begin(st.step, lr, st.loss, st.step_rng, clip)
            st.loss = None
            st.watch_calls = 0
            if self.config.policy != "observe":
                self.judge.before_update(lane.read_pre(quiet), quiet, False)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            contain(self, exc, PRE_HOOK)

    def _pre_packet(self, optimizer: torch.optim.Optimizer, lr: float | None,
                    clip: torch.Tensor | None) -> None:
        """The pre-hook's packet path (`watch.step`): loaded state to check, a replay armed,
        a scaler, a GPU, a sampled step; read before the update where something acts on it."""
        cfg, st, parts = self.config, self.state, self.parts
        loaded: list[str] = []
        flags: torch.Tensor | None = None
        if st.check_loaded:
            st.check_loaded = False
            loaded, flags = before.loaded_flags(st, parts, optimizer)
            for mismatch in loads.take_mismatches():  # `nanguard run`: verified at load
                # Said at load time (`report_mismatch`'s line, with why): not said twice.
                parts.log.add_alarm(loads.mismatch_alarm(st.step, mismatch), said=True)
        amp = parts.recovery.amp
        cur, grads = parts.steps.begin(st.step, lr, self.device, st.loss,
                                       amp.scale_tensor() if amp is not None else None,
                                       loaded, flags, st.step_rng, clip)
        st.current = cur
        pre = cur.pre
        st.loss = None
        st.watch_calls = 0
        replaying = self.replay is not None and parts.log.finding is None
        if cfg.policy == "observe" and not replaying and cfg.clip is None:
            if parts.cross_rank:  # observe's own agreement, every step: nothing to ask
                # here, but another rank may ask, and this one is its peer or a bystander.
                agreed = distributed.agree(False, None, agree_device(self.state))
                st.rerun_rank = agreed.rerun_rank
                st.agreed = True
                if st.rerun_rank is not None:
                    self.replays.cross_rerun(st.step, None, [], None)
            return
        if not replaying and cfg.clip is None and device_skip.applies(
                cfg, optimizer, grads, scaler_watched=amp is not None):
            # `skip` on the non-finite values alone, with a fused optimizer: the verdict goes to
            # the optimizer as its `found_inf` flag, no host read; recorded at the read.
            assert grads is not None
            found = device_skip.arm(optimizer, pre.slot("loss"), grads)
            pre.add("found_inf", found)
            cur.device_skip = True
            return
        # Acting policies decide before the update, and a replay needs the parameters as they
        # were before it: read the pre-step statistics now.
        self.judge.before_update(parts.steps.read_pre(cur), cur, replaying)

    @property
    def device(self) -> torch.device:
        """Where a step's packet is gathered: the first parameter's device (read each step: the
        model may be moved after the guard was built)."""
        if not self.state.params:
            return torch.device("cpu")
        p = self.state.params[0]  # `local(p)` inline: read every step
        if type(p) is not nn.Parameter and is_dtensor(p):  # (a plain parameter: no call)
            p = p.to_local()  # type: ignore[attr-defined]
        return p.device

    # -- after the update: one path, each step read judged the same way ----------------------------

    def post_hook(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """The step post-hook: runs right after the update (or where it would have been).
        One path for every step; only how the step is read differs (the reader: the quiet
        lane, or the packet path's `_read_after`), and each step read is judged
        (`Judge.after_update`). Fails open (`contain`, written here as in `pre_hook`)."""
        if self.error is not None:
            return
        try:
            st, parts = self.state, self.parts
            cur = st.current
            if cur is None:  # stood down in this very step's pre-hook
                return
            st.current, st.agreed = None, False
            steps = parts.recovery_steps
            if steps.after_update is not None:  # the scheduler's LR back before any read
                steps.after_update()
            if cur.device_skip:
                device_skip.disarm(optimizer)
            if st.stashed_grads is not None:
                self.acting.give_back_grads()
            if type(cur) is LaneStep:  # read right after the update, in one host read
                assert parts.lane is not None
                fresh = cur.stats is None  # an acting policy read its pre-update part already
                stats = parts.lane.read(cur)
                st.step += 1
                self.judge.after_update(cur, stats, fresh)
            else:
                assert isinstance(cur, Pending), "post-step hook without a pre-step hook"
                self._read_after(cur)
            if cur.stats is not None and steps.snapshot is not None:
                steps.snapshot(cur.stats)  # read before the update: what a rollback needs
            if parts.act_probe:  # activations on sampled steps, and through an alarm episode
                sampler = parts.steps.sampler
                last = sampler.last
                parts.act_probe.enabled = (
                    st.step % self.config.watch.activations_every == 0
                    or sampler.due <= st.step or (last is not None and bool(last.alarms)))
            if (sat := parts.saturation) is not None and st.step >= sat.due:  # arm, or disarm
                sat.after_step(st.step)
            if st.step % self.config.record.rng_every == 0:  # kept: every generator
                st.step_rng = rng.capture()
                parts.store.write_rng(st.step, rng.dumps(st.step_rng))
            else:  # every step: torch's generators, what a replay of the next step draws from
                st.step_rng = rng.capture_step()
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            contain(self, exc, POST_HOOK)

    def _read_after(self, cur: Pending) -> None:
        """The packet path's read after the update: the step joins the pending ones, read
        now (an acting policy, or every `read_every` steps) or, under `observe` on a GPU, one
        step later, once its copy to host memory is done (no stall); each is judged."""
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
            self.judge.after_update(p, stats, fresh)


_PARAMS = operator.itemgetter("params")
