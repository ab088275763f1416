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


def _total_as_clip(grads: list[torch.Tensor], norm_type: float) -> float:
    """The gradients' total norm as `clip_grad_norm_` measures it (per-tensor norms, then the
    norm of those, in their dtype): equal bit for bit to the total the script's clip returned
    for the same gradients and norm."""
    total = getattr(torch.nn.utils, "get_total_norm", None)
    if total is not None:  # torch >= 2.6: what `clip_grad_norm_` itself calls
        return float(total(grads, norm_type))
    if math.isinf(norm_type):
        return max(float(g.abs().max()) for g in grads)
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2)), 2))


def clipped_differing(grads: tuple[torch.Tensor | None, ...], trainable: list[torch.Tensor],
                      clip_norm: float) -> tuple[int, bool]:
    """Gradients of a re-run that differ from the step's own when the script clipped them
    (its `clip_grad_norm_` returned `clip_norm`): the step's `.grad` are the backward's times
    one clip coefficient, the re-run's are not. Returns (differing, exact).

    The clipped gradients are checked against the re-run's scaled by the ratio of their
    totals, within 1e-4 each; and the backward through the clip's total: the re-run's,
    measured as the clip measures it (L2, or the max norm), equal to `clip_norm` bit for bit
    makes the match `exact`. (A total that is not equal says little: the script may sum its
    parameters in another order, or clip in another norm.)"""
    pairs = [(g, p.grad) for g, p in zip(grads, trainable, strict=True)]
    missing = sum((g is None) != (p is None) for g, p in pairs)
    got = [(g.detach(), p.detach()) for g, p in pairs if g is not None and p is not None]
    if missing or not got:
        return missing, not missing
    rerun = [g for g, _ in got]
    totals = (_total_as_clip(rerun, 2.0), _total_as_clip(rerun, math.inf))
    exact = any(t == clip_norm or (math.isnan(t) and math.isnan(clip_norm)) for t in totals)
    if exact and not math.isfinite(clip_norm):
        # A non-finite total made the clip's coefficient NaN (or 0): it rewrote every
        # gradient, which only the total can be compared through.
        return 0, True
    ours = math.sqrt(sum(float(p.double().pow(2).sum()) for _, p in got))
    theirs = math.sqrt(sum(float(g.double().pow(2).sum()) for g, _ in got))
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs == 0:
        differing = sum(not _same(g, p) for g, p in got)
    else:
        scale = ours / theirs
        differing = sum(not torch.allclose(g.double() * scale, p.double(), rtol=1e-4,
                                           atol=1e-12) for g, p in got)
    return differing, exact and not differing


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
    clip_norm: float | None = None,
) -> dict[str, Any]:
    """Run the step again and compare its loss and every gradient with the step's own.

    Args:
        compute_loss: the step's forward and loss (`Guard(replay=...)`).
        model: its model (buffers restored after the re-run).
        params: the watched parameters, whose `.grad` holds the step's gradients.
        batch: the step's batch.
        step_rng: the RNG states at the start of the step (None: as they are now).
        loss: the loss the step computed (None when it was not watched).
        clip_norm: the total the script's own `clip_grad_norm_` returned this step (None:
            it did not clip): the step's gradients are clipped, the re-run's are compared
            through that total (`clipped_differing`).

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
    exact = True
    if reduced:
        differing = 0
    elif clip_norm is not None:
        differing, exact = clipped_differing(grads, trainable, clip_norm)
    else:
        differing = sum(not _same(g, p.grad) for g, p in zip(grads, trainable, strict=True))
    ctx = context(trainable)
    deterministic, device = ctx["deterministic_algorithms"], ctx["device"]
    verdict = "reproducible" if loss_same and differing == 0 else "transient"
    if verdict == "reproducible":
        why = ("the re-run gave the same loss bit for bit (its gradients were not compared: the "
               "step's are averaged across ranks): software or data" if reduced else
               "the re-run gave the same loss and gradients bit for bit: software or data"
               if exact else
               "the re-run gave the same loss bit for bit and the same gradients up to the "
               "script's clip (within 1e-4 once scaled as it scaled them): software or data")
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
