"""Re-execution verdicts: does an alarmed step run again the same, bit for bit?

A spike (or a non-finite value) that a second run of the same step from the same parameters,
RNG states and batch reproduces bit for bit comes from the software or the data: go on to
pinpoint and explain it. One that does not is `transient`: a non-deterministic kernel (atomic
adds in scatter / index_add, cuDNN autotuning, a reduction split across threads) or a hardware
fault. The verdict says which evidence points where: whether deterministic algorithms were on,
and the device. Large runs do the same (Megatron-LM's rerun state machine re-runs a step that
spiked; a mismatch there is a transient or a faulty device).

Runs only on an alarm, before the update, where the guard has the step's forward and loss
(`Guard(replay=...)`) and a single batch made the step's gradients: one extra forward and
backward, with `torch.autograd.grad` so `.grad`, the parameters and (restored) the buffers and
RNG states stay exactly as training left them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nanguard.pinpoint.inprocess import KeepBuffers, local
from nanguard.runtime import distributed
from nanguard.watch import rng

VERDICTS = ("reproducible", "transient", "persistent")
"""`persistent` (on rank r) comes only from a cross-rank re-run (`pinpoint.xrank`)."""


def alarms_to_explain(alarms: list[Any]) -> list[Any]:
    """The alarms of one check whose step is explained and re-run like a spike (layers,
    samples, `rerun`): every spike, and a gradient-norm overflow on a step without one. At
    step 0 the spike detector has no history, so a 1e37x gradient (a flipped top exponent bit)
    raises only the overflow: without it, the fault of the first step got no verdict and its
    cascade was diagnosed as the LR's."""
    # One per step: a step whose grad norm and loss both spiked is one event (one replay).
    spikes = [a for a in alarms if a.kind == "spike"][:1]
    return spikes or [a for a in alarms if a.kind == "overflow" and a.signal == "grad_norm"][:1]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, NaN where NaN is (torch.equal calls NaN unequal to itself)."""
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b)) and bool(torch.equal(a[~nan_a], b[~nan_b]))


def context(params: list[torch.Tensor]) -> dict[str, Any]:
    """What a verdict is read against: whether deterministic algorithms were on and the device
    the step ran on (a `transient` on a deterministic setup points at the hardware)."""
    return {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "device": params[0].device.type if params else "cpu"}


def run_again(compute_loss: Callable[[Any], torch.Tensor], *, model: nn.Module,
              trainable: list[torch.Tensor], batch: Any, step_rng: dict[str, Any] | None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """One more forward and backward of `batch` from the RNG states `step_rng` (None: as they
    are), on this rank alone (`local`): the loss and the gradients of `trainable`, with
    `torch.autograd.grad` so `.grad` stays as it is; the buffers and RNG states are put back."""
    now = rng.capture()
    keep = KeepBuffers(model)
    try:
        if step_rng is not None:
            rng.restore(step_rng)
        with local(model):
            out = compute_loss(batch)
            grads = torch.autograd.grad(out, trainable, allow_unused=True)
    finally:
        keep.__exit__()
        rng.restore(now)
    return out, grads


def grad_norm(grads: tuple[torch.Tensor | None, ...]) -> float:
    """The float64 norm of a re-run's gradients (inf when one overflows or is non-finite)."""
    sq = sum(float(g.detach().double().pow(2).sum()) for g in grads if g is not None)
    return math.sqrt(sq) if math.isfinite(sq) else math.inf


def rerun_verdict(
    compute_loss: Callable[[Any], torch.Tensor],
    *,
    model: nn.Module,
    params: list[torch.Tensor],
    batch: Any,
    step_rng: dict[str, Any] | None,
    loss: float | None,
) -> dict[str, Any]:
    """Run the step again and compare its loss and every gradient with the step's own.

    Args:
        compute_loss: the step's forward and loss (`Guard(replay=...)`).
        model: its model (buffers restored after the re-run).
        params: the watched parameters, whose `.grad` holds the step's gradients.
        batch: the step's batch.
        step_rng: the RNG states at the start of the step (None: as they are now).
        loss: the loss the step computed (None when it was not watched).

    Under a process group of more than one rank the step's gradients are the ranks' average
    (DDP's all-reduce), which a re-run of this rank's batch alone cannot give: there only the
    loss is compared (`grads_compared` False), and the re-run's backward runs without DDP's
    all-reduce (`no_sync`: it may run on this rank alone, no collective may wait for others).

    Returns:
        `{verdict, loss_same, grads_same, grads_compared, differing, deterministic_algorithms,
        device, why, local_grad_norm}`; `verdict` is `reproducible` or `transient`;
        `local_grad_norm` (under a process group only): the re-run's gradient norm on this
        rank alone (under DDP, which
        rank's batch carries a gradient spike all ranks see: `pinpoint.xrank`).
    """
    trainable = [p for p in params if p.requires_grad]
    reduced = distributed.active()
    out, grads = run_again(compute_loss, model=model, trainable=trainable, batch=batch,
                           step_rng=step_rng)
    value = float(out.detach().reshape(-1)[0]) if out.numel() else float("nan")
    loss_same = loss is None or value == loss or (math.isnan(value) and math.isnan(loss))
    differing = 0 if reduced else sum(
        not _same(g, p.grad) for g, p in zip(grads, trainable, strict=True))
    ctx = context(trainable)
    deterministic, device = ctx["deterministic_algorithms"], ctx["device"]
    verdict = "reproducible" if loss_same and differing == 0 else "transient"
    if verdict == "reproducible":
        why = ("the re-run gave the same loss bit for bit (its gradients were not compared: the "
               "step's are averaged across ranks): software or data" if reduced else
               "the re-run gave the same loss and gradients bit for bit: software or data")
    elif device == "cpu" or deterministic:
        why = (f"the re-run differs ({'loss' if not loss_same else ''}"
               f"{', ' if not loss_same and differing else ''}"
               f"{f'{differing} gradient(s)' if differing else ''}) although "
               f"{'deterministic algorithms were on' if deterministic else 'CPU kernels are'}"
               " deterministic: suspect the hardware, or state the forward keeps outside "
               "the RNG (a counter, Python's random, a data race)")
    else:
        why = (f"the re-run differs ({differing} gradient(s)"
               f"{', the loss' if not loss_same else ''}) with deterministic algorithms off: "
               "a non-deterministic kernel is the first suspect "
               "(torch.use_deterministic_algorithms(True) to tell it from a device fault)")
    return {"verdict": verdict, "loss_same": loss_same,
            "grads_same": None if reduced else differing == 0, "grads_compared": not reduced,
            "differing": differing, "deterministic_algorithms": deterministic,
            "device": device, "why": why,
            **({"local_grad_norm": grad_norm(grads)} if reduced else {})}
