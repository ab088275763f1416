"""Cross-rank re-execution: does another rank compute the alarmed rank's step the same?

A re-run on the rank that alarmed tells a transient (the same inputs ran differently there)
from a result that repeats; it cannot tell software or data from a device that computes
wrong every time. Under torch.distributed the alarmed rank's batch is therefore re-run on a
peer too, from the same parameters (replicas: the same bits before the update) and the same
RNG states, while the alarmed rank re-runs it once more itself (as Megatron-LM's rerun state
machine does). The ranks compare the loss and a bitwise fingerprint of the gradients
(`watch.replicas`: integer sums, not float norms):

- `transient`: the alarmed rank's own re-run differs from its step;
- `reproducible`: it repeats, and the peer computes the same bits: software or data;
- `persistent` on rank r: rank r repeats its own result but a peer computing the same batch
  gets another one: rank r's device is faulty.

How it stays safe. The request travels in the pre-step agreement every rank already makes
(`distributed.agree(want=...)`): a quiet step costs no collective more, and every rank
learns the same suspect from the same reduced value, so every rank runs the exchange below
or none does. The exchange is a few broadcasts from the suspect (a pickled header with the
batch's structure and the step's RNG states, then each tensor) and one all_gather of the
fingerprints, each waited for with a timeout (a peer that died raises instead of hanging).
The re-runs run without DDP's collectives (`inprocess.local`), with `torch.autograd.grad`
(`.grad` untouched), and put the buffers and RNG states back: training is unchanged, bit for
bit. Tensors travel on the group's device (the CPU under gloo, the rank's GPU under NCCL).
"""

from __future__ import annotations

import math
import pickle
import struct
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nanguard.pinpoint.rerun import run_again
from nanguard.runtime import distributed
from nanguard.watch.replicas import combine, tensor_fingerprints

Replay = Callable[[Any], torch.Tensor]

TIMEOUT_S = 120.0
"""How long a rank waits for the others in the exchange before it gives up (raises)."""


def priority(rerun: dict[str, Any] | None, *, own_loss: bool, transient_counts: bool = True
             ) -> int:
    """This rank's request for a cross-rank re-run of its step (0: none), for
    `distributed.agree(want=...)`: the highest request wins, then the lowest rank.

    A rank whose own re-run was `transient` comes first: the step ran differently there, so
    the alarm was its. Then a rank whose own loss alarmed (a non-finite loss or forward): the
    loss is its batch's alone, while DDP averages the gradients, so a gradient spike shows on
    every rank. Then the rank whose re-run carries the largest gradients on its own
    (`local_grad_norm`, in powers of two): the one whose batch or device made the spike.
    `transient_counts` False: this rank's `transient` says nothing of its own (a non-finite
    gradient that DDP's all-reduce brought from another rank never re-runs on this one).
    """
    if not rerun or rerun.get("verdict") not in ("reproducible", "transient"):
        return 0
    norm = rerun.get("local_grad_norm")
    size = 0
    if isinstance(norm, float) and norm > 0:
        size = 1023 if math.isinf(norm) else min(1023, max(1, round(math.log2(norm)) + 512))
    return (1 + size + (1024 if own_loss else 0)
            + (2048 if rerun["verdict"] == "transient" and transient_counts else 0))


class _Slot:
    """Where tensor `i` of the batch goes back in its structure (the header is pickled)."""

    def __init__(self, i: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.i, self.shape, self.dtype = i, shape, dtype


def _map(obj: Any, kind: type, fn: Callable[[Any], Any]) -> Any:
    """`obj` (dicts, lists, tuples, named tuples) with each leaf of type `kind` replaced by
    `fn(leaf)`; other leaves as they are."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, kind, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        parts = [_map(v, kind, fn) for v in obj]
        return type(obj)(*parts) if hasattr(obj, "_fields") else type(obj)(parts)
    return obj


def _split(batch: Any, tensors: list[torch.Tensor]) -> Any:
    """`batch` with each tensor replaced by a `_Slot` (the tensor appended to `tensors`)."""
    def take(t: torch.Tensor) -> _Slot:
        tensors.append(t.detach())
        return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype)
    return _map(batch, torch.Tensor, take)


def _wait(work: Any, timeout_s: float) -> None:
    if work is not None and not work.wait(timedelta(seconds=timeout_s)):
        raise TimeoutError(f"a rank did not join the cross-rank re-run within {timeout_s:.0f} s")


def _broadcast(t: torch.Tensor, src: int, timeout_s: float) -> None:
    _wait(dist.broadcast(t, src, async_op=True), timeout_s)


def exchange(batch: Any, step_rng: dict[str, Any] | None, *, src: int, device: torch.device,
             home: torch.device, timeout_s: float = TIMEOUT_S
             ) -> tuple[Any, dict[str, Any] | None] | None:
    """Every rank: rank `src`'s batch and step RNG states (what `src` passes; the others pass
    anything), as a copy on `home` (the parameters' device) on the other ranks; None on
    every rank when `src` could not pickle the batch's structure. `device`: the group's
    device, where the broadcasts run. A collective of the default group."""
    me = dist.get_rank()
    tensors: list[torch.Tensor] = []
    blob = b""
    if me == src:
        cuda = home.index if home.type == "cuda" else None
        try:
            blob = pickle.dumps((_split(batch, tensors), step_rng, cuda))
        except Exception:  # noqa: BLE001 - a batch that does not pickle: size 0, no re-run
            blob = b""
    size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
    _broadcast(size, src, timeout_s)
    if not int(size.item()):  # every rank sees the same size: all of them stop here
        return None
    data = (torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device) if me == src
            else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    _broadcast(data, src, timeout_s)
    if me == src:
        for t in tensors:
            _broadcast(t.to(device).contiguous(), src, timeout_s)
        return batch, step_rng
    header, state, cuda = pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 - our ranks
    slots: list[_Slot] = []
    _map(header, _Slot, slots.append)
    for slot in sorted(slots, key=lambda s: s.i):
        buf = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        _broadcast(buf, src, timeout_s)
        tensors.append(buf.to(home))
    return _map(header, _Slot, lambda slot: tensors[slot.i]), _as_mine(state, cuda, home)


def _as_mine(state: dict[str, Any] | None, cuda: int | None, home: torch.device
             ) -> dict[str, Any] | None:
    """The sender's RNG states for this rank: its GPU generator's state goes to this rank's
    GPU (ranks run on different devices); the CPU generator's as it is."""
    if state is None or "cuda" not in state or cuda is None or home.type != "cuda":
        return state
    mine = list(torch.cuda.get_rng_state_all())
    mine[home.index if home.index is not None else 0] = state["cuda"][cuda]
    return {**state, "cuda": mine}


def _bits(value: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _digest(compute_loss: Replay, model: nn.Module, params: list[torch.Tensor], batch: Any,
            step_rng: dict[str, Any] | None) -> tuple[float, int]:
    """(loss, bitwise gradient fingerprint) of one more run of `batch` on this rank."""
    trainable = [p for p in params if p.requires_grad]
    out, grads = run_again(compute_loss, model=model, trainable=trainable, batch=batch,
                           step_rng=step_rng)
    loss = float(out.detach().reshape(-1)[0]) if out.numel() else math.nan
    fps = tensor_fingerprints([g if g is not None else p.new_zeros(0)
                               for g, p in zip(grads, trainable, strict=True)])
    return loss, int(combine(fps))


def cross_rerun(compute_loss: Replay, *, suspect: int, model: nn.Module,
                params: list[torch.Tensor], batch: Any, step_rng: dict[str, Any] | None,
                loss: float | None, own: dict[str, Any] | None,
                timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    """Every rank, at the same point (after the agreement named `suspect`): re-run rank
    `suspect`'s batch there and on its peer `(suspect + 1) % world`, and return the verdict,
    the same on every rank. What the suspect passes counts (its batch, step RNG states, step
    loss and its own re-run's result `own`); the others' `batch`, `loss`, `own` are unused.

    Returns:
        `{verdict, rank, peer, loss_same, grads_same, why}` (`rank`: the suspect); `verdict`
        `reproducible`, `transient` or `persistent` (on `rank`), or None when a re-run failed.

    Raises:
        TimeoutError: a rank did not join within `timeout_s` (it died): the group is broken.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    peer = (suspect + 1) % world
    home = params[0].device if params else torch.device("cpu")
    device = distributed.group_device(home)
    sent = exchange(batch, step_rng, src=suspect, device=device, home=home,
                    timeout_s=timeout_s)
    if sent is None:
        return {"rank": suspect, "peer": peer, "verdict": None,
                "why": f"rank {suspect}'s batch could not be sent (its structure does not pickle)"}
    batch, step_rng = sent
    row = [0, 0, 0, 0]  # [ran, loss bits, gradient fingerprint, the suspect repeats its step]
    failed = ""
    if me in (suspect, peer):
        try:
            value, fp = _digest(compute_loss, model, params, batch, step_rng)
            repeats = (own is not None and own.get("verdict") == "reproducible"
                       and (loss is None or _bits(value) == _bits(loss)
                            or (math.isnan(value) and math.isnan(loss))))
            row = [1, _bits(value), fp, int(repeats)]
        except Exception as exc:  # noqa: BLE001 - a verdict must never stop training
            failed = f"{type(exc).__name__}: {exc}"
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    _wait(dist.all_gather(rows, mine, async_op=True), timeout_s)
    (s_ran, s_loss, s_fp, s_repeats), (p_ran, p_loss, p_fp, _) = (
        rows[suspect].tolist(), rows[peer].tolist())
    base = {"rank": suspect, "peer": peer}
    if not (s_ran and p_ran):
        where = suspect if not s_ran else peer
        return {**base, "verdict": None,
                "why": f"the cross-rank re-run failed on rank {where}" + (
                    f": {failed}" if failed else "")}
    loss_same, grads_same = s_loss == p_loss, s_fp == p_fp
    if not s_repeats:
        return {**base, "verdict": "transient", "loss_same": loss_same, "grads_same": grads_same,
                "why": f"rank {suspect}'s own re-run differs from its step: the same inputs "
                       "ran differently on the same rank"}
    if loss_same and grads_same:
        return {**base, "verdict": "reproducible", "loss_same": True, "grads_same": True,
                "why": f"rank {suspect} repeats its step and rank {peer} computes the same "
                       "loss and gradients from its batch, bit for bit: software or data"}
    differ = " and ".join(w for w, same in (("loss", loss_same), ("gradients", grads_same))
                          if not same)
    return {**base, "verdict": "persistent", "loss_same": loss_same, "grads_same": grads_same,
            "why": f"rank {suspect} repeats its own result, but rank {peer} computes another "
                   f"{differ} from the same batch, parameters and RNG states: rank {suspect}'s "
                   "device computes wrong (a faulty device, not software or data)"}


def label(verdict: dict[str, Any]) -> str:
    """The verdict in words: `persistent on rank 1`, `transient`, `reproducible`."""
    v = verdict.get("verdict")
    return f"persistent on rank {verdict['rank']}" if v == "persistent" else str(v)
