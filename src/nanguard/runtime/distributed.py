"""Rank agreement under torch.distributed: one small int32 all-reduce per decision.

Every rank computes its own verdict; `agree` reduces them so that all ranks take the same
action in the same step (none skips while another updates, none hangs waiting for a rank that
stopped). It uses MAX only (NCCL cannot reduce bool, and one collective is cheaper than two). Which
rank the value came from: under DDP every rank's gradients go non-finite together once one rank
fed a NaN into the all-reduce, so "the lowest rank with a NaN" would name rank 0. The verdict
therefore carries the phase where each rank saw it (data < forward < loss < backward <
optimizer) and MAX picks the earliest phase, then the lowest rank.

A fourth column carries a cross-rank re-run request (`want`, `pinpoint.xrank`): a rank whose
alarmed step re-ran on it asks for its batch to be re-run on a peer too; MAX picks one
suspect for every rank alike, so the re-run costs no collective on a quiet step.

A rider (`ride`) travels in the next agreement instead of its own collective: the replica
check's fingerprint on the steps it is due. That agreement then gathers every rank's
[act, score, down, want, *payload] (one all_gather of int64) and takes the MAX of the first
four itself: the same decision, and the payloads for free.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

log = logging.getLogger("nanguard")


def active() -> bool:
    """True inside an initialized process group with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


PHASE_ORDER = ("data", "forward", "loss", "backward", "optimizer")


@dataclass(kw_only=True)
class Rider:
    """A payload for the next agreement (`ride`)."""

    payload: torch.Tensor
    """An int64 vector of the same length on every rank."""
    done: Callable[[list[list[int]]], None]
    """Called inside that agreement with every rank's payload (row r: rank r's), on every
    rank at the same point: it may run collectives of its own there."""


_rider: Rider | None = None
_over = False  # an agreement carried a `down`: no rank agrees any more in this process


def ride(payload: torch.Tensor, done: Callable[[list[list[int]]], None]) -> None:
    """Send `payload` with the next agreement (every rank must do the same before it)."""
    global _rider
    _rider = Rider(payload=payload.reshape(-1).to(torch.int64), done=done)


def rider_pending() -> bool:
    """A rider no agreement has taken yet."""
    return _rider is not None


def drop_rider() -> None:
    global _rider
    _rider = None


def lockstep_over() -> bool:
    """Whether an agreement said a rank stood down: after it no rank agrees again, so nothing
    can ride any more (every rank knows it from the same agreement)."""
    return _over


class PeerStoodDown(RuntimeError):
    """Another rank's guard stood down after an internal error and said so in an agreement:
    this rank stands down too, in the same step, so that no rank waits in a collective the
    others will not join."""

    def __init__(self, rank: int) -> None:
        super().__init__(f"rank {rank} stood down after an internal error of nanguard's own; "
                         "every rank stands down with it (none may wait in a collective the "
                         "others will not join)")
        self.rank = rank


class Agreed(NamedTuple):
    """What an agreement decided, the same on every rank."""

    act: bool
    """Some rank acts on this step."""
    bad_rank: int | None
    """Where the non-finite value showed first (earliest phase, then lowest rank), or None."""
    rerun_rank: int | None = None
    """The rank whose batch every rank re-runs across ranks now (`pinpoint.xrank`), or None."""
    keep: bool = False
    """Every rank that acts only lets the update go ahead (`agree(hold=True)`): no rank
    discards it."""


def _top_rank(best: int, world: int) -> int | None:
    # best % world == (world - rank) % world: 0 for rank 0, else world - rank.
    return None if not best else (world - best % world) % world


def agree(act: bool, nonfinite_phase: str | None, device: torch.device, *,
          down: bool = False, want: int = 0, hold: bool = False) -> Agreed:
    """Reduce this rank's verdict with every other rank's.

    Args:
        act: this rank wants to act (skip / raise / rollback) on this step.
        hold: with `act`, this rank's policy acts only to let the update go ahead (a spike of
            a recurring instability, `policy.recurrence`): `Agreed.keep` when every acting
            rank says so; one rank that discards the update outweighs it.
        nonfinite_phase: where this rank saw a non-finite value on this step (a name from
            PHASE_ORDER, "" if unknown), or None when it saw none.
        device: where the collective runs (the gradients' device; CPU for gloo).
        down: this rank's guard has stood down: this is the last agreement it takes part in
            (`LockstepExit`), and it tells the others.
        want: this rank asks for a cross-rank re-run of its step's batch, with this priority
            (`pinpoint.xrank.priority`; 0: no). The highest one wins, then the lowest rank.

    Returns:
        `Agreed`: whether any rank acts, the rank where the value showed first, the rank whose
        batch is re-run across ranks. Without a process group: this rank's own verdict (and
        no cross-rank re-run).

    Raises:
        PeerStoodDown: another rank said `down` (not raised on the rank that said it).
    """
    if not active():
        return Agreed(act, rank() if nonfinite_phase is not None else None, keep=act and hold)
    world, me = dist.get_world_size(), dist.get_rank()
    device = group_device(device)
    score = 0
    if nonfinite_phase is not None:
        order = PHASE_ORDER.index(nonfinite_phase) if nonfinite_phase in PHASE_ORDER else 3
        score = (len(PHASE_ORDER) - order) * world + (world - me)
    asks = want * world + (world - me) if want > 0 else 0
    global _rider, _over
    rider, _rider = _rider, None
    head = [(1 if hold else 2) if act else 0, score, world - me if down else 0, asks]
    if rider is None:
        flags = torch.tensor(head, dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        any_act, best, gone, asked = flags.tolist()
    else:
        mine = torch.cat([torch.tensor(head, dtype=torch.int64, device=device),
                          rider.payload.to(device)])
        rows = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(rows, mine)
        table = torch.stack(rows).tolist()
        any_act, best, gone, asked = (max(col) for col in list(zip(*table, strict=True))[:4])
        try:
            rider.done([row[4:] for row in table])
        except Exception:  # noqa: BLE001 - the rider's own failure is not this decision's
            log.exception("nanguard: a payload of the rank agreement failed")
    if down or gone:
        _over = True
    if gone and not down:
        raise PeerStoodDown(world - gone)
    return Agreed(bool(any_act), _top_rank(best, world), None if down else _top_rank(asked, world),
                  keep=any_act == 1)


def group_device(device: torch.device) -> torch.device:
    """Where a collective of the default group takes its tensors: the CPU under gloo, else
    `device` (NCCL: the rank's GPU)."""
    return torch.device("cpu") if dist.get_backend() == "gloo" else device


class LockstepExit:
    """The one agreement a rank still owes the others after its guard stood down.

    Acting policies agree every step's decision across ranks twice: before the update and
    after it. A guard that stands down between two agreements would leave the other ranks
    waiting in the next one (and then pairing it with DDP's own all-reduces: a hang or a
    crash). So it takes part in that next agreement with `down=True`, which makes every other
    rank stand down in the same call, and then no rank makes another.

    Args:
        optimizer: the guard's optimizer (its step hooks mark the agreement points).
        device: where the agreement's collective runs.
        hooked: the guard hooked `optimizer.step()`; False for framework adapters, which call
            `pay` from `before_update` / `after_update`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device,
                 hooked: bool) -> None:
        self.optimizer = optimizer
        self.device = device
        self.hooked = hooked
        self.owed: str | None = None
        self._handle: Any = None

    @classmethod
    def after_stand_down(cls, exc: BaseException, optimizer: torch.optim.Optimizer,
                         device: torch.device, *, hooked: bool, observe: bool,
                         cross_rank: bool, in_hook: str | None,
                         agreed: bool) -> LockstepExit | None:
        """What a guard that just stood down on `exc` (`Guard.stand_down`) owes the other
        ranks: None when they agree nothing with it, else its exit, paid at once or owed.

        Args:
            observe: the guard's policy is `observe`: it agrees only for the cross-rank
                re-run (`cross_rank`), once a step, before the update.
            in_hook: the step hook it stood down in (`pre` / `post`), None outside one.
            agreed: that hook had already taken part in its agreement.
        """
        if not ((not observe or cross_rank) and active()
                and not isinstance(exc, PeerStoodDown)):
            return None
        # The other ranks agree every decision with this one: take part in the next
        # agreement, saying so, and every rank stands down in it (nobody waits). Under
        # `observe` (agreeing for the cross-rank re-run) there is one, before the update.
        exit_ = cls(optimizer, device, hooked)
        if in_hook is not None and not agreed and not (observe and in_hook == "post"):
            exit_.pay_now()  # the others are in this hook's agreement now
        else:
            exit_.owe("post" if in_hook == "pre" and not observe else "pre")
        return exit_

    def pay_now(self) -> None:
        """Take part in the agreement the other ranks are in right now."""
        self.owed = None
        self.close()
        # A broken group: nothing more to owe (and nothing to raise into training).
        with contextlib.suppress(Exception):
            agree(False, None, self.device, down=True)

    def owe(self, when: str) -> None:
        """Take part in the next agreement, at the next `pre` or `post` update point."""
        assert when in ("pre", "post")
        self.owed = when
        if self.hooked:
            register = (self.optimizer.register_step_pre_hook if when == "pre"
                        else self.optimizer.register_step_post_hook)
            self._handle = register(lambda *_: self.pay(when))

    def pay(self, when: str) -> None:
        """At an update point: the owed agreement, if it is this one's."""
        if self.owed == when:
            self.pay_now()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
