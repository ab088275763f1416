"""The guard's recovery side: rollback, adaptive clipping and GradScaler awareness.

The step pipeline owns one `Recovery` and calls it at fixed points of a step; each feature is
off (and costs nothing) unless its policy, config or object was given: `per_step` names the
parts a step runs, chosen once when the pipeline is built. Its pieces live beside it: the
GradScaler's watch (`recover.amp`), the samples a rollback leaves out (`recover.left_out`),
the snapshots, clipping, backoff and `heal`.

What recovery needs from its guard is `GuardLink` (`recover.link`), nothing else: the
settings, the model and optimizer, the step counter, the spikes seen so far, and a way to hand
effects to a coupled guard. What recovery decides for its own guard it returns as effects
(`recover.effects`: record an action, record an alarm, discard the coming update, stop the
run) that the guard applies; this module never imports the Guard.

Several optimizers on one model (e.g. body and head trained apart, one guard each, `rollback`
policy): each guard's snapshot holds only what its own optimizer trains, so a rollback restores
parameters together with their optimizer state. When one of them rolls back, every other
rolling-back guard of the same model rolls back to its own last good state in the same
training step (they were trained on the same losses): one that has already made this step's
update undoes it, one whose update is still to come discards it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from nanguard.detect.alarm import Alarm
from nanguard.policy.lr_change import LrChanges
from nanguard.recover.amp import ScalerWatch
from nanguard.recover.backoff import Backoff, decide
from nanguard.recover.clip import AdaptiveClipper
from nanguard.recover.effects import Discard, Effect, FollowPeers, Record, Stop
from nanguard.recover.heal import Healer
from nanguard.recover.left_out import LeftOut
from nanguard.recover.link import GuardLink
from nanguard.recover.ring import SnapshotRing
from nanguard.recover.rollback import GiveUp, Rollback, trouble_start
from nanguard.recover.skips import SkipLedger
from nanguard.runtime import distributed
from nanguard.watch import loads
from nanguard.watch.stats import StepStats


class PerStep(NamedTuple):
    """The parts of recovery that a step runs under this configuration (`Recovery.per_step`),
    each None where it has nothing to do."""

    check_amp: Callable[[StepStats], tuple[list[Effect], list[Alarm]]] | None
    """Before the detectors of a step read: the scaler's skipped steps and collapse (with a
    scaler only: `ScalerWatch.check`)."""
    after_update: Callable[[], None] | None
    """First thing after the update: the LR as the schedule set it (`rollback`, `heal`)."""
    snapshot: Callable[[StepStats], None] | None
    """After a step read before its update: the last good state refreshed when due
    (`rollback`; `heal` watches the step there too)."""


# Rolling-back recoveries per model: one rollback takes the other optimizers of the model along.
_PEERS: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Recovery]] = (
    weakref.WeakKeyDictionary()
)


class Recovery:
    """Args:
    link: what it needs of the guard it serves (`GuardLink`).
    scheduler: LR scheduler restored by a rollback (optional).
    scaler: `torch.amp.GradScaler` (optional).
    """

    def __init__(self, link: GuardLink, *, scheduler: Any = None, scaler: Any = None) -> None:
        self.link = link
        cfg = link.config
        self.rollbacker: Rollback | None = None
        self._discard_next = False  # a peer rolled back this step before our update ran
        # ...and our restore waits for our step: (its step, the other optimizer, its LR factor)
        self._follow_at: tuple[int, str, float] | None = None
        # With rolling-back peers: the next step after this optimizer's last update in the
        # current training step, and whether all its steps since the last capture were healthy.
        self._round: int | None = None
        self._round_ok = True
        if cfg.policy == "rollback" or (cfg.policy == "skip"
                                        and cfg.recover.skip_escalation == "rollback"):
            budget = cfg.recover.snapshot_budget_mb
            snapshot = SnapshotRing(
                link.model, link.optimizer, extras={"scheduler": scheduler, "scaler": scaler},
                slots=cfg.recover.snapshot_slots,
                budget_bytes=None if budget is None else int(budget * 2**20),
            )
            # The initial state is the first "last good" one (taken between steps).
            snapshot.capture(link.step, in_step=False)
            self.rollbacker = Rollback(cfg.recover, snapshot, link.optimizer)
            self._group: Any = link.model
            _PEERS.setdefault(self._group, weakref.WeakSet()).add(self)
        self.steps_rolled_back = 0  # updates undone by rollbacks (the cost, for the report)
        self.left_out = LeftOut(link.spikes)
        """Samples a rollback named, whose batches are left out (`recover.left_out`)."""
        self.clipper = AdaptiveClipper(cfg.clip) if cfg.clip is not None else None
        self.amp = (ScalerWatch(scaler, cfg.amp, cfg.detect.cooldown) if scaler is not None
                    else None)
        """The GradScaler's watch (None without a scaler: nothing of it runs)."""
        # The LR of the last step (every policy: an LR jump is an alarm under `observe` too);
        # the guard feeds it before the update, `heal` ramps from it.
        self.lr_changes = LrChanges()
        # `nanguard run` builds a guard at the first step: the optimizer's state was loaded
        # before it, with the LR the checkpoint was saved at.
        self.lr_changes.load(loads.loaded_lr(link.optimizer))
        self.healer = (Healer(cfg.heal, link, self.lr_changes) if cfg.policy == "heal"
                       else None)
        self.skips = SkipLedger(scheduler, link.optimizer)  # every discarded update
        self._rolled_back_at: int | None = None  # a rollback's discard is not a skip

    def per_step(self) -> PerStep:
        """What a step runs of recovery under this configuration, chosen once when the
        pipeline is built: a part with nothing to do here (no scaler; neither `rollback` nor
        `heal`) is None, and the step leaves it out rather than calling it to return."""
        check_amp = self.amp.check if self.amp is not None else None
        if self.rollbacker is not None:
            return PerStep(check_amp=check_amp, after_update=self.after_update,
                           snapshot=self.maybe_snapshot)
        if self.healer is not None:  # heal alone: its own methods, no frame more
            return PerStep(check_amp=check_amp, after_update=self.healer.after_update,
                           snapshot=self.healer.observe)
        return PerStep(check_amp=check_amp, after_update=None, snapshot=None)

    # -- before / after the update

    def before_update(self, stats: StepStats) -> list[Effect]:
        """Pre-hook, when the update goes ahead: a rollback of another optimizer of the model
        in this step discards it; else adaptive clipping (applied here: the gradients are
        scaled in place), then the LR backoff. Returns what the guard is to apply."""
        if self._discard_next:
            return self._take_discard(stats)
        if self.left_out.named and (left := self.left_out.check(stats)):  # (none: no call)
            return left
        effects: list[Effect] = []
        if self.clipper is not None:
            action, scale = self.clipper.decide(
                stats.grad_norm if not stats.nonfinite_grads else math.nan
            )
            if action == "skip":
                return [Discard(stats), Record(
                    stats.step,
                    "skip",
                    "non-finite grad norm: update discarded, clip statistics kept",
                )]
            if action == "clip":
                grads = [p.grad for g in self.link.optimizer.param_groups for p in g["params"]
                         if p.grad is not None]
                torch._foreach_mul_(grads, scale)
                effects.append(Record(
                    stats.step,
                    "clip",
                    f"grad norm {stats.grad_norm:.3g} clipped by {scale:.3g} "
                    f"(adaptive threshold {stats.grad_norm * scale:.3g})",
                ))
        if self.rollbacker is not None:
            self.rollbacker.backoff_on(stats.step)
        if self.healer is not None:
            effects += self.healer.before_update(stats)
        return effects

    def discarded(self, stats: StepStats, *, late: bool) -> None:
        """The guard discarded the update of `stats` (`late`: seen after the step ended, a
        fused optimizer's flag read later): counted; a skip's scheduler step taken back
        before the next update where it can be (`recover.skips`)."""
        hold = not late and self._rolled_back_at != stats.step
        self.skips.skipped(stats.step, stats.lr, hold=hold)

    def after_update(self) -> None:
        if self.healer is not None:  # first: its LR was applied on top of any backoff
            self.healer.after_update()
        if self.rollbacker is not None:
            self.rollbacker.backoff_off()

    def maybe_snapshot(self, stats: StepStats) -> None:
        """Post-hook, once the step is read: refresh the last good state when it is due.

        With other rolling-back guards on the same model, the refresh waits until every one of
        them has stepped too (the end of the training step), and happens only when all of them
        were healthy: a snapshot taken after this optimizer's update, while another optimizer
        of the model is still to find that step bad, could not undo this update."""
        if self.healer is not None:
            self.healer.observe(stats)
        if self.rollbacker is None:
            return
        self.rollbacker.trail.observe(stats)
        if stats.alarms:
            self.left_out.note_spikes(stats)
        healthy = not stats.alarms and not stats.nonfinite_signals() and not stats.skipped
        if distributed.active() and (stats.step + 1) % self.rollbacker.config.snapshot_every == 0:
            # Every rank must keep the same last good step, or a rollback would desync them.
            healthy = not distributed.agree(not healthy, None, self._device())[0]
        peers = self._peers()
        if not peers:
            self.rollbacker.maybe_capture(stats.step + 1, healthy, self._trouble(stats))
            return
        self._round = stats.step + 1
        self._round_ok = self._round_ok and healthy
        group = [self, *peers]
        if any(r._round is None for r in group):
            return  # another optimizer of the model has not stepped yet
        ok = all(r._round_ok for r in group)
        for r in group:
            assert r.rollbacker is not None and r._round is not None
            r.rollbacker.maybe_capture(r._round, ok)
            r._round, r._round_ok = None, True

    def _trouble(self, stats: StepStats) -> int:
        return trouble_start(stats.step, stats.alarms, self.link.config.detect)

    def _device(self) -> torch.device:
        for g in self.link.optimizer.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def rollback(self, stats: StepStats, why: str, post: bool) -> list[Effect]:
        """The `rollback` policy's action (all ranks call it in the same step): the model is
        restored here; returns the records, the discard of the coming update and, last, the
        other rolling-back guards of the same model following (see the module docstring)."""
        assert self.rollbacker is not None
        if self._discard_next and not post:
            # A coupled guard rolled this one back already in this step.
            return self._take_discard(stats)
        if not post and self.left_out and (left := self.left_out.check(stats)):
            # A sample an earlier rollback named is back (the next epoch): the state before
            # this update is good, discarding the update is all it takes; no rollback, no
            # progress lost, no compounded backoff.
            return left
        rb = self.rollbacker
        rb.trail.observe(stats)  # this step's own magnitudes (before the update: grad norm)
        backoff = decide(stats, rb.trail, self.link.config.recover, self.link.config.detect)
        try:
            restored = rb.rollback(stats.step, backoff=backoff,
                                   trouble_from=self._trouble(stats))
            self.steps_rolled_back += stats.step + 1 - restored
        except GiveUp as exc:
            return [Record(stats.step, "give_up", f"{exc} ({why})"), Stop(stats, f"{exc} ({why})")]
        rb.trail.clear(stats.step)
        self._rolled_back_at = stats.step
        culprits = self.left_out.remember(stats, restored)
        effects: list[Effect] = [] if post else [Discard(stats)]
        stats.skipped = True
        effects.append(Record(
            stats.step,
            "rollback",
            f"restored the state of step {restored}, discarding steps {restored}..{stats.step} "
            f"({why}); {self._lr_text(backoff)}"
            + (f"; {len(culprits)} sample(s) left out from now on (fingerprint(s) "
               f"{', '.join(f'{h:#x}' for h in culprits[:4])})" if culprits else ""),
        ))
        effects.append(FollowPeers(stats.step, type(self.link.optimizer).__name__, rb.factor))
        return effects

    def follow_peers(self, step: int, optimizer: str, factor: float) -> None:
        """Apply a `FollowPeers` effect: every other rolling-back guard of the model rolls
        back with this one (each applies its own records)."""
        for peer in self._peers():
            peer._follow(step, optimizer, factor)

    def _lr_text(self, backoff: Backoff) -> str:
        """What the last rollback did to the LR, and why (`actions[].detail`)."""
        assert self.rollbacker is not None
        rb, cfg = self.rollbacker, self.rollbacker.config
        text = (f"LR kept: {backoff.why}" if rb.factor == 1.0 else
                f"LR x{rb.factor:.3g} for {cfg.backoff_steps} steps: {backoff.why}")
        if rb.repeat:
            text += (f"; rollback {len(rb.history)} within {cfg.window} steps (the last at step "
                     f"{rb.history[-2]}): compounded with its x{rb.compounded:.3g}")
        return text

    def escalate(self, stats: StepStats, why: str, post: bool) -> list[Effect] | None:
        """`skip` cannot heal (too many skips in a row, or a bad update already applied): roll
        back when `recover.skip_escalation` is `rollback` (its effects); None otherwise (the
        guard then gives up)."""
        if self.rollbacker is None:
            return None
        return self.rollback(stats, f"skipping did not heal: {why}", post)

    def _peers(self) -> list[Recovery]:
        peers = _PEERS.get(self._group) if self.rollbacker is not None else None
        if not peers:
            return []
        return [r for r in list(peers)
                if r is not self and r.rollbacker is not None and r.link.active]

    def _follow(self, step: int, other: str, factor: float) -> None:
        """Roll back with another optimizer of the same model that rolled back at `step` (its
        training step). This guard's update of that step, if still to come, is discarded."""
        assert self.rollbacker is not None
        pending = self.link.step <= step  # this optimizer has not stepped in that step yet
        self._round_ok = False  # no snapshot from this training step
        if pending:
            # Restored in this guard's own step, after its backward: its parameters may still
            # be in a graph the script has yet to backpropagate (a GAN's `fake`), and an
            # in-place restore now would break that backward.
            self._discard_next = True
            self._follow_at = (step, other, factor)
            return
        self.link.apply(self._restore_with(self.link.step - 1, step, other, factor))

    def _restore_with(self, mine: int, step: int, other: str, factor: float) -> list[Effect]:
        assert self.rollbacker is not None
        restored = self.rollbacker.rollback(
            mine, forced=True, backoff=Backoff(factor=factor, why=f"as the {other} optimizer"))
        self.rollbacker.trail.clear(mine)
        return [Record(
            mine,
            "rollback",
            f"restored the state of step {restored} with the {other} optimizer it is coupled "
            f"to (it rolled back at its step {step}); "
            + (f"LR x{factor:.3g} for {self.rollbacker.config.backoff_steps} steps"
               if factor != 1.0 else "LR kept") + f", as the {other} optimizer's",
        )]

    def _take_discard(self, stats: StepStats) -> list[Effect]:
        """This step's update is discarded because a coupled guard rolled back: restore the
        last good state now (after this optimizer's backward), then make the update a no-op."""
        self._discard_next = False
        self._rolled_back_at = stats.step  # not a skip: the model goes back with its peers
        effects: list[Effect] = []
        if self._follow_at is not None:
            step, other, factor = self._follow_at
            self._follow_at = None
            effects += self._restore_with(self.link.step, step, other, factor)
        effects.append(Discard(stats))
        stats.skipped = True
        return effects

    def couple(self, group: Any) -> None:
        """Roll back together with every other rolling-back guard coupled to `group` (any
        weak-referenceable object), not only those of the same model: a GAN's generator and
        discriminator are trained on each other's outputs, so restoring one alone would pair
        it with the other's later state. `nanguard run` couples all the guards of a script."""
        if self.rollbacker is None:
            return
        old = _PEERS.get(self._group)
        if old is not None:
            old.discard(self)
        self._group = group
        _PEERS.setdefault(group, weakref.WeakSet()).add(self)

    def cost(self) -> dict[str, Any] | None:
        """What rollback cost so far (None without the `rollback` policy): updates undone, the
        LR factor now applied, the host memory the snapshots hold (and how many), the budget;
        under `heal`, `heal`: its own cost and cause (`Healer.cost`)."""
        skips = {"skips": c} if (c := self.skips.cost()) is not None else {}
        if self.rollbacker is None:
            return ({"heal": self.healer.cost(), **skips} if self.healer is not None
                    else skips or None)
        ring = self.rollbacker.snapshot
        budget = self.link.config.recover.snapshot_budget_mb
        return {"rollbacks": len(self.rollbacker.history),
                "updates_rolled_back": self.steps_rolled_back,
                "lr_factor": self.rollbacker.factor,
                "samples_left_out": len(self.left_out.named),
                "updates_left_out": self.left_out.updates,
                "snapshot_bytes": ring.nbytes,
                "snapshots": len(ring.slots),
                "snapshot_budget_bytes": None if budget is None else int(budget * 2**20),
                "snapshot_over_budget": ring.over_budget,
                **({"heal": self.healer.cost()} if self.healer is not None else {}),
                **skips}

    # -- state

    def state_dict(self) -> dict[str, Any]:
        return {
            "rollback": self.rollbacker.state_dict() if self.rollbacker else None,
            "clip": self.clipper.state_dict() if self.clipper else None,
            "amp": self.amp.state_dict() if self.amp else None,
            "left_out": self.left_out.state_dict(),
            "heal": self.healer.state_dict() if self.healer else None,
            "lr": self.lr_changes.state_dict(),
            "skips": self.skips.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part, obj in (("rollback", self.rollbacker), ("clip", self.clipper), ("amp", self.amp),
                          ("heal", self.healer)):
            if obj is not None and state.get(part) is not None:
                obj.load_state_dict(state[part])
        self.left_out.load_state_dict(state.get("left_out", {}))
        if state.get("lr") is not None:  # absent in states saved before it
            self.lr_changes.load_state_dict(state["lr"])
        if state.get("skips") is not None:
            self.skips.load_state_dict(state["skips"])
        if self.rollbacker is not None and not self.rollbacker.snapshot.in_step:
            # The snapshot taken when this guard was built is the state at the step resumed
            # from (the guard's step counter, already loaded), not at step 0.
            self.rollbacker.snapshot.step = self.link.step
