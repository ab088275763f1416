"""A spike without a NaN: which layers carry it, which samples cause it.

Layers: each parameter's gradient norm on the batch against a baseline (typical norms from
healthy steps, e.g. the run store's per-parameter history); without a baseline, against the
median over parameters. Samples: per-sample gradient norms with `torch.func`
(`vmap(grad(loss))` over the batch through `functional_call`), outliers by a robust z-score of
the log norm (median and MAD), so one sample 25x larger than the rest stands out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


@dataclass(kw_only=True)
class SpikeReport:
    """Where a gradient spike sits."""

    layers: list[dict[str, Any]] = field(default_factory=list)
    """`{param, module, norm, baseline, ratio}` for parameters over `layer_ratio`, largest
    ratio first."""
    samples: list[dict[str, Any]] = field(default_factory=list)
    """`{index, norm, z}` for samples with outlying gradient norms, largest first."""
    grad_norms: dict[str, float] = field(default_factory=dict)
    """Every parameter's gradient norm on the batch."""
    sample_norms: list[float] = field(default_factory=list)
    """Every sample's gradient norm (empty when per-sample gradients were skipped)."""

    def to_dict(self) -> dict[str, Any]:
        return {"layers": self.layers, "samples": self.samples}


def spike_attribution(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    baseline: Mapping[str, float] | None = None,
    layer_ratio: float = 10.0,
    sample_z: float = 3.5,
    per_sample: bool = True,
) -> SpikeReport:
    """Name the layers and samples behind a gradient spike on `batch`.

    Leaves `.grad` and the model untouched (gradients are computed functionally).

    Args:
        model: the model; per-sample gradients need it free of batch-coupled layers in train
            mode (BatchNorm): call it in eval mode or pass `per_sample=False`.
        loss_fn: `loss_fn(output, target)` with mean reduction, as in training.
        batch: `(inputs, targets)` sharing the leading batch dimension.
        baseline: typical gradient norm per parameter name on healthy steps; None compares each
            parameter with the median of all.
        layer_ratio: a parameter carries the spike when its norm is this many times baseline.
        sample_z: robust z-score (log norm) above which a sample is an outlier.
        per_sample: also compute per-sample gradient norms.

    Returns:
        A `SpikeReport`.
    """
    x, y = batch
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss_fn(model(x), y), list(params.values()), allow_unused=True)
    norms = {n: 0.0 if g is None else float(g.detach().double().norm())
             for n, g in zip(params, grads, strict=True)}
    report = SpikeReport(grad_norms=norms)
    if norms:
        ref = sorted(norms.values())[len(norms) // 2]
        for n, v in norms.items():
            base = float(baseline.get(n, ref)) if baseline is not None else ref
            ratio = v / base if base > 0 else math.inf
            if ratio >= layer_ratio or not math.isfinite(v):
                report.layers.append({"param": n, "module": n.rpartition(".")[0], "norm": v,
                                      "baseline": base, "ratio": ratio})
        report.layers.sort(key=lambda d: -d["ratio"] if math.isfinite(d["ratio"]) else -1e308)
    if per_sample:
        report.sample_norms = _per_sample_norms(model, loss_fn, x, y)
        report.samples = norm_outliers(report.sample_norms, sample_z)
    return report


def _per_sample_norms(model: nn.Module, loss_fn: Callable[..., torch.Tensor], x: torch.Tensor,
                      y: torch.Tensor) -> list[float]:
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return loss_fn(out, yi.unsqueeze(0))

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    sq = sum(v.reshape(v.shape[0], -1).double().pow(2).sum(1) for v in g.values())
    return [float(v) for v in torch.as_tensor(sq).sqrt()]


def norm_outliers(norms: list[float], z: float, level: float | None = None
                  ) -> list[dict[str, Any]]:
    """The values of `norms` (positive: per-sample gradient norms or losses) far above the
    rest, by a robust z-score of their logs, largest first: `{index, norm, z}`.

    Without `level`: against the batch's own median and MAD, which holds while outliers are a
    minority (with 11-16 of 32 rows corrupted the MAD is inflated and most go unnamed). With
    `level` (a per-row loss's level before the spike: the guard's recent loss): corruption
    raises a row's loss, so the rows at or below `level` are clean; their log-distance below
    it gives the spread (the MAD of a clean row's log loss around the level, one-sided), and
    a row is flagged by its distance above `level`, however many rows are corrupted. Falls
    back to the batch's own estimate when fewer than 3 rows sit at or below `level`.
    """
    if len(norms) < 3:
        return []
    logs = torch.tensor([math.log(max(v, 1e-300)) for v in norms], dtype=torch.float64)
    med = logs.median()
    mad = (logs - med).abs().median() * 1.4826
    if level is not None and math.isfinite(level) and level > 0:
        centre = math.log(level)
        below = logs[logs <= centre]
        if below.numel() >= 3:
            med = torch.tensor(centre, dtype=torch.float64)
            mad = (centre - below).median() * 1.4826
    scale = float(mad) if float(mad) > 1e-12 else 1e-12
    scores = ((logs - med) / scale).tolist()
    out = [{"index": i, "norm": norms[i], "z": s} for i, s in enumerate(scores) if s > z]
    return sorted(out, key=lambda d: -d["z"])
