"""Replica agreement under data parallelism: do all ranks still hold the same parameters, bit
for bit?

Under DDP every rank applies the same all-reduced gradient to the same parameters, so replicas
agree exactly; one that does not was corrupted (a flipped bit in memory or in a kernel, a rank
that skipped an update alone, a non-deterministic optimizer). Every `every` steps, after the
update, each rank computes a fingerprint of its parameters and the ranks compare them in one
all_gather of three int64 values: their own under `observe`; under an acting policy, which
agrees every step's decision across ranks anyway, inside that agreement
(`distributed.ride`: one all_gather of [act, score, down, fingerprint, count, layout] instead
of the agreement's all-reduce plus the check's all_gather). Only when they differ, a second
all_gather of the per-tensor fingerprints names the tensors. Every rank computes the same
verdict from the same gathered values, so all of them record the same `replica_divergence`
alarm in the same step.

The fingerprint and the verdict (which rank is wrong) are `watch.replica_prints`'. Cost: one
vectorized integer sum per tensor, about what a norm of the parameters costs (BENCHMARKS.md),
plus the collectives, every `every` steps.
"""

from __future__ import annotations

import logging
import weakref
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nanguard.detect.alarm import Alarm
from nanguard.runtime import distributed
from nanguard.watch.replica_prints import (
    ReplicaDivergence,
    combine,
    compare,
    device_of,
    fingerprint_head,
    layout_code,
    settle,
    tensor_fingerprints,
)

__all__ = ["ReplicaCheck", "ReplicaDivergence", "attach", "combine", "compare",
           "fingerprint_head", "layout_code", "ranks_without_check", "register", "settle",
           "tensor_fingerprints"]

log = logging.getLogger("nanguard")


class Host(Protocol):
    """What the check uses of the guard it serves (the Guard is one; never imported here)."""

    model: Any
    optimizer: torch.optim.Optimizer
    error: dict[str, Any] | None

    @property
    def step(self) -> int: ...

    @property
    def params(self) -> list[torch.Tensor]: ...

    @property
    def param_names(self) -> list[str]: ...

    @property
    def closed(self) -> bool: ...

    def record_alarm(self, alarm: Alarm) -> None: ...



_KEY = "nanguard/replicas/guard/{}"


def _store() -> Any:
    """The default group's key-value store, or None (a private torch API: absent, no check)."""
    try:
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - an older or newer torch: the check goes on without it
        return None


def register() -> None:
    """Say, in the group's store (no collective), that this rank has a replica check."""
    store = _store()
    if store is not None:
        store.set(_KEY.format(dist.get_rank()), "1")


REGISTER_WAIT_S = 10.0
"""How long the check before the first update waits for every rank to register."""


def ranks_without_check(wait_s: float = REGISTER_WAIT_S) -> list[int]:
    """Ranks that have not called `register` after waiting up to `wait_s` for all of them ([]
    also when the store is unavailable). The wait matters: the ranks reach their first step
    at different times (under `nanguard run` a guard is built inside a rank's first
    `optimizer.step()`), and a rank that looked before another registered would turn its
    check off while that other one went into the all_gather: a hang. Every rank with a check
    waits for the same keys, so all of them see every key, or all of them time out on the
    rank that has no guard (at the cost of one `wait_s` stall, once)."""
    store = _store()
    keys = [_KEY.format(r) for r in range(dist.get_world_size())]
    if store is None or store.check(keys):
        return []
    try:
        store.wait(keys, timedelta(seconds=wait_s))
        return []
    except Exception:  # noqa: BLE001 - torch raises a timeout (its type varies by version)
        return [r for r, key in enumerate(keys) if not store.check([key])]


class ReplicaCheck:
    """The guard's replica check: compares the replicas before the first update, after it, and
    after every `every`-th update.

    The check before the first update proves the start state and decides whether there is
    anything to check: DDP broadcast rank 0's parameters when it was built and no update has
    run yet, so replicas agree there, and ranks that do not are no replicas. It turns the check
    off, with one log line and no alarm, when some rank has no guard (read from the group's
    store before any collective: the all_gather would wait for it forever), when the ranks'
    parameter layouts differ (pipeline parallel), or when the parameters differ before any
    update on a model that is not a `DistributedDataParallel` (tensor parallel, FSDP1 flat
    shards, a model per rank: not replicas). A DDP model's replicas agree by construction, so
    there a difference before the first update is already a `replica_divergence`. From then on
    a difference is a fault, from the first update on: a bit flipped during step 0 is named
    after step 0 (the check used to start after step 0's update, read such a flip as "not
    replicas" and turn itself off for the whole run).

    Runs in optimizer hooks of its own (registered before the guard's, so before the guard's
    pre-step agreement and after each update, before the guard's post-step reads), on every
    rank at the same step: it counts the optimizer's steps itself, so the ranks stay in
    lockstep even if one rank's guard stands down after an internal error (that rank keeps
    taking part in the collective, and records nothing). A divergence is recorded once as a
    `replica_divergence` alarm (never acted on by a policy); the same divergence seen again at
    the next checks is not repeated. Removes its hooks once the guard is closed or gone.
    """

    def __init__(self, guard: Host, every: int, *, rides: bool = False) -> None:
        self.every = every
        self.rides = rides
        """Carry the fingerprint in the guard's post-step agreement (`distributed.ride`)
        instead of an all_gather of its own: acting policies agree every step anyway."""
        self._guard = weakref.ref(guard)
        self.divergences: list[ReplicaDivergence] = []
        self.checks = 0
        self.rode = 0  # of those checks, the ones that travelled in the guard's agreement
        self.step = guard.step  # the index of the step in progress, counted by this hook
        self._first = True  # the first update's post-step check is due
        self._last: tuple[tuple[int, ...], tuple[tuple[int, tuple[str, ...]], ...]] | None = None
        register()
        self._start: Any = guard.optimizer.register_step_pre_hook(self._before_first)
        self._handle: Any = guard.optimizer.register_step_post_hook(self._after_step)

    def remove(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in (self._start, self._handle):
            if handle is not None:
                handle.remove()
        self._start = self._handle = None

    def _off(self, why: str) -> None:
        log.warning("replica check off: %s (DetectConfig.replica_every=0 silences this)", why)
        self.every = 0

    def _before_first(self, *_: object) -> None:
        """Before the first update: do the ranks hold replicas at all? (see the class)."""
        if not self._first:
            return  # (the hook goes in the next post-step: hooks cannot leave while they run)
        guard = self._guard()
        if guard is None or guard.closed:
            self.remove()
            return
        if not self.every:
            return
        if missing := ranks_without_check():
            self._off(
                f"rank(s) {', '.join(map(str, missing))} have no Guard; the check is a "
                "collective and needs one on every rank"
            )
            return
        self.checks += 1
        try:
            found = compare(guard.step, guard.param_names, guard.params)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self._off(str(exc))
            return
        if found is None:
            return
        if not isinstance(guard.model, DistributedDataParallel):
            self._off(
                "the ranks' parameters differ before the first update: not data-parallel "
                "replicas (tensor parallel, FSDP1 shards, or a model per rank)"
            )
            return
        # DDP broadcast rank 0's parameters when it was built: replicas by construction, so a
        # difference now is a fault since (a rank whose memory changed, code that wrote to one
        # rank's parameters), not another kind of parallelism.
        found.before_update = True
        self._last = (tuple(found.ranks),
                      tuple((r, tuple(n)) for r, n in sorted(found.tensors.items())))
        if guard.error is None:
            self.divergences.append(found)
            guard.record_alarm(found.alarm())

    def _after_step(self, *_: object) -> None:
        guard = self._guard()
        if guard is None or guard.closed:
            self.remove()
            return
        step, self.step = self.step, self.step + 1
        first, self._first = self._first, False
        if self._start is not None:
            self._start.remove()
            self._start = None
        if not self.every or (not first and (step + 1) % self.every):
            return
        self.checks += 1
        if self.rides and not distributed.lockstep_over():
            if not distributed.rider_pending():
                self._ride(guard)
                return
            # The last one found no agreement to ride (a `skip` decided on the device alone
            # agrees nothing): the same on every rank, so every rank stops riding here.
            distributed.drop_rider()
            self.rides = False
        try:
            found = compare(guard.step, guard.param_names, guard.params)
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            self._off(str(exc))
            return
        self._record(guard, found)

    def _ride(self, guard: Host) -> None:
        """Send this check's head with the guard's next agreement; judge it there."""
        step, names = guard.step, guard.param_names
        try:
            per_tensor, head = fingerprint_head(names, guard.params, device_of(guard.params))
        except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
            # Every rank must still send a head of the same length: a zero one, judged as
            # "not replicas" by the layout column, turns the check off on every rank.
            per_tensor, head = torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
            log.warning("replica check: fingerprint failed: %s", exc)

        def done(rows: list[list[int]]) -> None:
            try:
                found = settle(step, names, per_tensor, rows)
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                self._off(str(exc))
                return
            if self._guard() is guard:
                self._record(guard, found)

        distributed.ride(head, done)
        self.rode += 1

    def _record(self, guard: Host, found: ReplicaDivergence | None) -> None:
        if found is None:
            self._last = None
            return
        sig = (tuple(found.ranks), tuple((r, tuple(n)) for r, n in sorted(found.tensors.items())))
        if sig != self._last and guard.error is None:
            self.divergences.append(found)
            guard.record_alarm(found.alarm())
        self._last = sig


def attach(guard: Host, every: int, *, rides: bool = False) -> ReplicaCheck | None:
    """The guard's replica check (`DetectConfig.replica_every`): None when `every` is 0, outside
    a process group of more than one rank, or when the parameters are sharded (DTensor: each
    rank holds a different shard, not a replica). `rides`: the guard agrees every step's
    decision across ranks (an acting policy), and the check's fingerprint travels in that
    agreement (`ReplicaCheck.rides`)."""
    if not every or not distributed.active():
        return None
    if any(type(p).__name__ == "DTensor" for p in guard.params):
        return None
    return ReplicaCheck(guard, every, rides=rides)
