"""Check a model before training: init scale per layer, BatchNorm eps, a sigmoid feeding
BCELoss, whether it can overfit one batch, and at which LR the loss starts to diverge.

Everything that trains runs on deep copies with fresh optimizers of the same class and
hyperparameters, inside `torch.random.fork_rng`: the user's model, optimizer and RNG streams
are left exactly as they were.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from nanguard.audit._common import Finding

INIT_TOO_LARGE = 10.0  # weight std / (1/sqrt(fan_in)); PyTorch's default init gives ~0.58
INIT_TOO_SMALL = 0.01


@dataclass(kw_only=True)
class PreflightConfig:
    overfit_steps: int = 100
    """Steps of training on the single batch."""
    overfit_ratio: float = 0.1
    """Overfitting succeeds when the final loss is below this fraction of the first."""
    lr_min: float = 1e-6
    """First LR of the range probe."""
    lr_max: float = 10.0
    """Last LR of the range probe."""
    lr_steps: int = 40
    """Steps of the range probe (LR grows geometrically from lr_min to lr_max)."""
    diverge_factor: float = 4.0
    """The probe stops when the loss exceeds this multiple of its best value so far."""
    seed: int = 0
    """Seed for the copies' training (the caller's RNG state is restored afterwards)."""


@dataclass(kw_only=True)
class LayerInit:
    name: str
    fan_in: int
    std: float
    ratio: float  # std * sqrt(fan_in): ~0.58 PyTorch default, ~1.41 Kaiming (ReLU)


@dataclass(kw_only=True)
class OverfitResult:
    steps: int
    first_loss: float
    final_loss: float
    success: bool


@dataclass(kw_only=True)
class LRProbeResult:
    lrs: list[float]
    losses: list[float]
    diverge_lr: float | None  # first LR where the loss blew up; None if it never did
    suggested_lr: float | None  # a tenth of diverge_lr (or of the LR of the lowest loss)


@dataclass(kw_only=True)
class PreflightReport:
    findings: list[Finding] = field(default_factory=list)
    layers: list[LayerInit] = field(default_factory=list)
    overfit: OverfitResult | None = None
    lr_probe: LRProbeResult | None = None

    @property
    def ok(self) -> bool:
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def __str__(self) -> str:
        lines = ["nanguard preflight"]
        if self.overfit:
            o = self.overfit
            lines.append(
                f"  overfit one batch: {'ok' if o.success else 'FAILED'} "
                f"(loss {o.first_loss:.4g} -> {o.final_loss:.4g} in {o.steps} steps)"
            )
        if self.lr_probe:
            p = self.lr_probe
            sug = f"{p.suggested_lr:.3g}" if p.suggested_lr else "-"
            div = (
                f"loss diverges at lr {p.diverge_lr:.3g}"
                if p.diverge_lr
                else f"loss does not diverge up to lr {p.lrs[-1]:.3g}"
            )
            lines.append(f"  LR range probe: {div}; suggested lr {sug}")
        for f in self.findings:
            lines.append(
                f"  {f.severity} {f.code}: {f.message}" + (f" (fix: {f.fix})" if f.fix else "")
            )
        if not self.findings:
            lines.append("  no problems found")
        return "\n".join(lines)

    def __rich__(self) -> str:
        from rich.markup import escape

        return escape(str(self))


def _call(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _fresh_optimizer(optimizer: Any, model: Any, copy_model: Any, lr: float | None = None) -> Any:
    """An optimizer of the user's class and hyperparameters over the copy's parameters."""
    import torch

    if optimizer is None:
        return torch.optim.Adam(copy_model.parameters(), lr=lr or 1e-3)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    params = list(copy_model.parameters())
    groups = []
    for g in optimizer.param_groups:
        hp = {k: v for k, v in g.items() if k != "params"}
        if lr is not None:
            hp["lr"] = lr
        groups.append(
            {**hp, "params": [params[index[id(p)]] for p in g["params"] if id(p) in index]}
        )
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k != "lr"})


def _init_findings(model: Any, report: PreflightReport) -> None:
    from torch import nn

    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.modules.conv._ConvNd)) and mod.weight.dim() >= 2:
            w = mod.weight.detach()
            fan_in, _ = nn.init._calculate_fan_in_and_fan_out(w)
            std = float(w.float().std()) if w.numel() > 1 else 0.0
            ratio = std * math.sqrt(fan_in)
            report.layers.append(LayerInit(name=name, fan_in=fan_in, std=std, ratio=ratio))
            expected = 1 / math.sqrt(fan_in)
            if not math.isfinite(std) or ratio > INIT_TOO_LARGE:
                report.findings.append(
                    Finding(
                        code="exploding_init",
                        severity="error",
                        location=name,
                        message=f"{name}: weight std {std:.3g} is {ratio:.3g}x 1/sqrt(fan_in) "
                        f"= {expected:.3g} (Kaiming/Xavier give 0.6-1.4x)",
                        fix=f"re-initialise {name}.weight, e.g. with "
                        "nn.init.kaiming_uniform_(w, nonlinearity='relu'), or drop the custom init",
                        details={"std": std, "expected": expected, "ratio": ratio},
                    )
                )
            elif 0 < ratio < INIT_TOO_SMALL:
                report.findings.append(
                    Finding(
                        code="vanishing_gradients",
                        severity="warning",
                        location=name,
                        message=f"{name}: weight std {std:.3g} is only {ratio:.3g}x 1/sqrt(fan_in)",
                        fix="use the default init or nn.init.xavier_uniform_",
                    )
                )
        bn = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)
        if isinstance(mod, bn) and getattr(mod, "eps", 1.0) is not None and mod.eps <= 1e-8:
            report.findings.append(
                Finding(
                    code="norm_eps",
                    severity="warning",
                    location=name,
                    message=f"{name}: {type(mod).__name__} eps={mod.eps:g} divides a constant "
                    "channel by ~0",
                    fix="use eps=1e-5",
                )
            )


def _sigmoid_bce(model: Any, inputs: Any, loss_fn: Any, report: PreflightReport) -> Any:
    """Run one forward pass (on the copy, no grad kept) and check for sigmoid -> BCE."""
    import torch
    from torch import nn

    order: list[nn.Module] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: order.append(m))
        for m in model.modules()
        if not list(m.children())
    ]
    try:
        out = _call(model, inputs)
    finally:
        for h in hooks:
            h.remove()
    is_bce = isinstance(loss_fn, nn.BCELoss) or loss_fn is torch.nn.functional.binary_cross_entropy
    grad_fn = type(getattr(out, "grad_fn", None)).__name__
    ends_in_sigmoid = (order and isinstance(order[-1], nn.Sigmoid)) or "Sigmoid" in grad_fn
    if is_bce and ends_in_sigmoid:
        report.findings.append(
            Finding(
                code="saturated_loss",
                severity="warning",
                location="loss_fn",
                message="the model ends in a sigmoid and the loss is BCELoss: saturates "
                "(loss clamped at 100, zero gradient) and is unsafe under autocast",
                fix="remove the final sigmoid and use nn.BCEWithLogitsLoss",
            )
        )
    return out


def _loss(model: Any, inputs: Any, targets: Any, loss_fn: Any) -> Any:
    return loss_fn(_call(model, inputs), targets)


def _overfit(
    model: Any, optimizer: Any, batch: Any, loss_fn: Any, cfg: PreflightConfig
) -> OverfitResult:
    inputs, targets = batch
    m = copy.deepcopy(model).train()
    opt = _fresh_optimizer(optimizer, model, m)
    first = last = math.nan
    for step in range(cfg.overfit_steps):
        opt.zero_grad(set_to_none=True)
        loss = _loss(m, inputs, targets, loss_fn)
        last = float(loss.detach())
        if step == 0:
            first = last
        if not math.isfinite(last):
            break
        loss.backward()
        opt.step()
    ok = math.isfinite(last) and last <= cfg.overfit_ratio * first
    return OverfitResult(steps=cfg.overfit_steps, first_loss=first, final_loss=last, success=ok)


def _lr_probe(
    model: Any, optimizer: Any, batch: Any, loss_fn: Any, cfg: PreflightConfig
) -> LRProbeResult:
    inputs, targets = batch
    m = copy.deepcopy(model).train()
    opt = _fresh_optimizer(optimizer, model, m, lr=cfg.lr_min)
    growth = (cfg.lr_max / cfg.lr_min) ** (1 / max(cfg.lr_steps - 1, 1))
    lrs, losses, best, best_lr, diverge = [], [], math.inf, None, None
    lr = cfg.lr_min
    for _ in range(cfg.lr_steps):
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = _loss(m, inputs, targets, loss_fn)
        value = float(loss.detach())
        lrs.append(lr)
        losses.append(value)
        if not math.isfinite(value) or value > cfg.diverge_factor * best:
            diverge = lr
            break
        if value < best:
            best, best_lr = value, lr
        loss.backward()
        opt.step()
        lr *= growth
    ref = diverge if diverge is not None else best_lr
    return LRProbeResult(
        lrs=lrs, losses=losses, diverge_lr=diverge, suggested_lr=ref / 10 if ref else None
    )


def preflight(
    model: Any,
    batch: Any,
    loss_fn: Any,
    optimizer: Any = None,
    *,
    config: PreflightConfig | None = None,
) -> PreflightReport:
    """Check a model before training it.

    Args:
        model: The `nn.Module`. It is never modified: training happens on deep copies.
        batch: ``(inputs, targets)``; `inputs` is a tensor, a tuple (``model(*inputs)``) or a
            dict (``model(**inputs)``).
        loss_fn: Called as ``loss_fn(model(inputs), targets)``; returns a scalar tensor.
        optimizer: The optimizer you will train with; its class and hyperparameters are used
            for fresh optimizers over the copies, its state is not touched. Adam(lr=1e-3)
            when None.
        config: Step counts and thresholds.

    Returns:
        Findings (init scale, norm eps, sigmoid -> BCE, cannot overfit, LR too high), the
        per-layer init ratios, the overfit result and the LR range probe.
    """
    import torch

    cfg = config or PreflightConfig()
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("batch must be a pair (inputs, targets)")
    report = PreflightReport()
    _init_findings(model, report)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        # With grad on: the output's grad_fn shows a sigmoid applied inside forward().
        _sigmoid_bce(copy.deepcopy(model), batch[0], loss_fn, report)
        report.overfit = _overfit(model, optimizer, batch, loss_fn, cfg)
        torch.manual_seed(cfg.seed)
        report.lr_probe = _lr_probe(model, optimizer, batch, loss_fn, cfg)
    o = report.overfit
    if not math.isfinite(o.first_loss):
        report.findings.append(
            Finding(
                code="nonfinite_loss",
                severity="error",
                location="loss_fn",
                message=f"the loss of the untrained model is already {o.first_loss}",
                fix="check the inputs (nanguard scan) and the init",
            )
        )
    elif not o.success:
        report.findings.append(
            Finding(
                code="cannot_overfit",
                severity="warning",
                location="model",
                message=f"loss went {o.first_loss:.4g} -> {o.final_loss:.4g} in {o.steps} steps on "
                "one batch: the model cannot fit even that",
                fix="check labels vs outputs, the loss, frozen parameters, and the LR",
            )
        )
    p = report.lr_probe
    lr_now = optimizer.param_groups[0]["lr"] if optimizer is not None else None
    if p.diverge_lr is not None and lr_now is not None and lr_now >= p.diverge_lr:
        report.findings.append(
            Finding(
                code="optimizer_divergence",
                severity="warning",
                location="optimizer",
                message=f"lr {lr_now:g} is at or above the LR where the loss diverges on this "
                f"batch ({p.diverge_lr:.3g})",
                fix=f"use lr <= {p.suggested_lr:.3g}",
            )
        )
    return report
