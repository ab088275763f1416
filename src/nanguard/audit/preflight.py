"""Check a model before training: init scale per layer, BatchNorm eps, a sigmoid feeding
BCELoss, whether it can overfit one batch, and at which LR the loss starts to diverge.

Everything that trains runs on deep copies (made without the model's hooks) with fresh
optimizers of the same class and hyperparameters, inside `torch.random.fork_rng`: the user's
model, optimizer and RNG streams are left exactly as they were.

The forward check runs the model and the loss once under a small `TorchDispatchMode`, so what
it finds is what the code computes, however it is written: a `binary_cross_entropy` fed by a
`sigmoid` (a module, `torch.sigmoid` inside `forward`, or the loss module), a `log` of a
sigmoid / softmax output with no floor, a `log` of a value <= 0 on this very batch.

The LR range probe runs first; the overfit check then trains at the lower of the optimizer's LR
and the probe's suggested LR, so a too-high LR (reported on its own) does not also read as a
model that cannot learn.
"""

from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nanguard.audit.common import AuditFinding, json_safe

INIT_TOO_LARGE = 10.0  # weight std / (1/sqrt(fan_in)); PyTorch's default init gives ~0.58
INIT_TOO_SMALL = 0.01
LR_NEAR = 3.0
"""An LR within this factor below the probe's divergence point is a warning (above it: error)."""
_RELU_LIKE = ("ReLU", "LeakyReLU", "PReLU", "RReLU", "ReLU6", "ELU", "SELU", "CELU", "GELU",
              "SiLU", "Mish", "Hardswish")


@dataclass(kw_only=True)
class PreflightConfig:
    overfit_steps: int = 100
    """Steps of training on the single batch."""
    overfit_ratio: float = 0.5
    """Overfitting succeeds when the final loss is below this fraction of the first. Not
    lower: a loss with a floor above 0 (label smoothing) cannot get far below it, while what
    this check is for (a graph cut by `detach()`, frozen parameters, softmax fed to
    CrossEntropyLoss, targets the output cannot express) leaves the loss near where it began."""
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
    lr: float | None = None
    """The LR the copy trained at (None: the optimizer's own, or Adam's default)."""


@dataclass(kw_only=True)
class LRProbeResult:
    lrs: list[float]
    losses: list[float]
    diverge_lr: float | None  # first LR where the loss blew up; None if it never did
    suggested_lr: float | None  # a tenth of diverge_lr (or of the LR of the lowest loss)


@dataclass(kw_only=True)
class PreflightReport:
    findings: list[AuditFinding] = field(default_factory=list)
    layers: list[LayerInit] = field(default_factory=list)
    overfit: OverfitResult | None = None
    lr_probe: LRProbeResult | None = None
    user_lr: float | None = None
    """The optimizer's LR (its scheduler's base LR when that is higher); None without one."""
    seconds: float = 0.0
    """Wall time the preflight took."""

    @property
    def ok(self) -> bool:
        return not any(f.severity in ("error", "warning") for f in self.findings)

    @property
    def errors(self) -> list[AuditFinding]:
        """Error-level findings (what `nanguard run --preflight-only` fails on)."""
        return [f for f in self.findings if f.severity == "error"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite floats as strings, as in report.json)."""
        return dict(json_safe({
            "findings": [f.to_dict() for f in self.findings],
            "layers": [asdict(layer) for layer in self.layers],
            "overfit": asdict(self.overfit) if self.overfit else None,
            "lr_probe": asdict(self.lr_probe) if self.lr_probe else None,
            "user_lr": self.user_lr,
            "seconds": round(self.seconds, 3),
        }))

    def __str__(self) -> str:
        lines = [f"nanguard preflight ({self.seconds:.1f} s)"]
        if self.overfit:
            o = self.overfit
            at = f" at lr {o.lr:.3g}" if o.lr is not None else ""
            lines.append(
                f"  overfit one batch: {'ok' if o.success else 'FAILED'} "
                f"(loss {o.first_loss:.4g} -> {o.final_loss:.4g} in {o.steps} steps{at})"
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


def copy_model(model: Any) -> Any:
    """A deep copy of `model` without its hooks (a monitor's forward hooks hold references to
    the monitor: copying them would copy it, and running them would feed it the copy's
    values). Parameter and buffer values, `requires_grad` and train/eval mode are kept."""
    from collections import OrderedDict

    memo: dict[int, Any] = {}
    for m in model.modules():
        for name, value in vars(m).items():
            if name.endswith("_hooks") or "_hooks_" in name:
                if isinstance(value, dict):
                    memo[id(value)] = OrderedDict()
                elif isinstance(value, set):
                    memo[id(value)] = set()
    return copy.deepcopy(model, memo)


def _call(model: Any, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def user_lr(optimizer: Any) -> float | None:
    """The LR the optimizer trains at: the largest over its groups of the current LR and the
    base LR a scheduler keeps (`initial_lr`: a warm-up starts below it)."""
    if optimizer is None:
        return None
    lrs = [
        float(v)
        for g in optimizer.param_groups
        for v in (g.get("lr"), g.get("initial_lr"))
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    return max(lrs) if lrs else None


def _fresh_optimizer(optimizer: Any, model: Any, copy_model: Any, lr: float | None = None) -> Any:
    """An optimizer of the user's class and hyperparameters over the copy's parameters."""
    import torch

    if optimizer is None:
        return torch.optim.Adam(copy_model.parameters(), lr=lr or 1e-3)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    params = list(copy_model.parameters())
    groups = []
    for g in optimizer.param_groups:
        hp = {k: v for k, v in g.items() if k not in ("params", "initial_lr")}
        if lr is not None:
            hp["lr"] = lr
        elif isinstance(g.get("initial_lr"), (int, float)):
            hp["lr"] = g["initial_lr"]  # a warm-up's first LR is not the one it trains at
        mine = [params[index[id(p)]] for p in g["params"] if id(p) in index]
        if mine:
            groups.append({**hp, "params": mine})
    if not groups:
        raise ValueError("the optimizer holds none of the model's parameters")
    # Every group carries all the hyperparameters; the constructor gets the defaults it
    # accepts (AdamW keeps `decoupled_weight_decay` in its defaults but takes no such argument).
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    anything = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    return cls(groups, **{k: v for k, v in optimizer.defaults.items()
                          if k != "lr" and (anything or k in accepted)})


def _init_fix(name: str, after: str | None) -> str:
    w = f"model.get_submodule({name!r}).weight" if name else "model.weight"
    if after in _RELU_LIKE:
        return f"nn.init.kaiming_normal_({w}, nonlinearity='relu')"
    if after == "Tanh":
        return f"nn.init.xavier_normal_({w}, gain=nn.init.calculate_gain('tanh'))"
    return f"nn.init.xavier_uniform_({w})"


def _init_findings(model: Any, report: PreflightReport, after: dict[str, str]) -> None:
    """Per Linear / Conv layer: weight std against 1/sqrt(fan_in); norm layers' eps.

    Args:
        after: layer name -> class name of the leaf module the forward ran right after it
            (its activation, when it has one): picks the init call of the fix.
    """
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
                call = _init_fix(name, after.get(name))
                report.findings.append(
                    AuditFinding(
                        code="exploding_init",
                        severity="error",
                        location=name,
                        message=f"{name or 'model'}: weight std {std:.3g} is {ratio:.3g}x "
                        f"1/sqrt(fan_in) = {expected:.3g} (Kaiming/Xavier give 0.6-1.4x)",
                        fix=f"{call}, or drop the custom init "
                        "(PyTorch's default gives 0.58x)",
                        details={"std": std, "expected": expected, "ratio": ratio,
                                 "fan_in": fan_in, "init_call": call},
                    )
                )
            elif 0 < ratio < INIT_TOO_SMALL:
                report.findings.append(
                    AuditFinding(
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
                AuditFinding(
                    code="norm_eps",
                    severity="warning",
                    location=name,
                    message=f"{name}: {type(mod).__name__} eps={mod.eps:g} divides a constant "
                    "channel by ~0",
                    fix="use eps=1e-5",
                )
            )


def _forward_watch() -> Any:
    """A dispatch mode that sees the ops of one forward + loss (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class ForwardWatch(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.where: list[str] = []
            self.squashed: dict[int, tuple[str, str]] = {}  # data_ptr -> (op, module)
            self.keep: list[torch.Tensor] = []  # keeps those storages (and pointers) alive
            self.hits: list[dict[str, Any]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            op = func.overloadpacket.__name__
            module = self.where[-1] if self.where else ""
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if op in ("sigmoid", "_softmax", "softmax") and isinstance(out, torch.Tensor):
                self.squashed[out.data_ptr()] = (op.strip("_"), module)
                self.keep.append(out)
            elif x is not None and op in ("log", "log2", "log10", "binary_cross_entropy"):
                lo = float(x.detach().min()) if x.numel() and x.is_floating_point() else math.nan
                src = self.squashed.get(x.data_ptr())
                self.hits.append({"op": op, "module": module, "min": lo,
                                  "source": src[0] if src else None,
                                  "source_module": src[1] if src else None})
            return out

    return ForwardWatch()


def _forward_check(
    model: Any, inputs: Any, targets: Any, loss_fn: Any, report: PreflightReport
) -> dict[str, str]:
    """Run the forward and the loss once (on a copy) and report what the ops show.

    Returns:
        Layer name -> class name of the leaf module that ran right after it.
    """
    from torch import nn

    names = {id(m): n for n, m in model.named_modules()}
    watch = _forward_watch()
    order: list[nn.Module] = []

    def pre(m: nn.Module, _: Any) -> None:
        watch.where.append(names.get(id(m), ""))

    def post(m: nn.Module, _: Any, __: Any) -> None:
        if watch.where:
            watch.where.pop()
        if not list(m.children()):
            order.append(m)

    hooks = [h for m in model.modules()
             for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        with watch:
            out = _call(model, inputs)
            if loss_fn is not None:
                loss_fn(out, targets)
    finally:
        for h in hooks:
            h.remove()
    after = {names.get(id(a), ""): type(b).__name__ for a, b in zip(order, order[1:], strict=False)}
    ends_in_sigmoid = bool(order) and isinstance(order[-1], nn.Sigmoid)
    said = set()
    for hit in watch.hits:
        where = f" in `{hit['module']}`" if hit["module"] else ""
        if hit["op"] == "binary_cross_entropy" and (hit["source"] == "sigmoid"
                                                     or ends_in_sigmoid):
            code = "saturated_loss"
            finding = AuditFinding(
                code=code, severity="warning", location="loss_fn",
                message="the model's output goes through a sigmoid into binary_cross_entropy "
                "(BCELoss): it saturates (loss clamped at 100, zero gradient) and is unsafe "
                "under autocast",
                fix="remove the final sigmoid and use nn.BCEWithLogitsLoss",
            )
        elif hit["op"] != "binary_cross_entropy" and hit["min"] <= 0:
            code = "log_of_nonpositive"
            finding = AuditFinding(
                code=code, severity="error", location=hit["module"],
                message=f"torch.{hit['op']}{where} gets a value <= 0 on this batch (min "
                f"{hit['min']:.3g}): -inf / NaN from the first step",
                fix=f"floor the input: torch.{hit['op']}(x.clamp_min(1e-12))",
                details={"min": hit["min"]},
            )
        elif hit["op"] != "binary_cross_entropy" and hit["source"]:
            code = "log_without_floor"
            alt = "F.log_softmax" if hit["source"] == "softmax" else "F.logsigmoid"
            finding = AuditFinding(
                code=code, severity="warning", location=hit["module"],
                message=f"torch.{hit['op']}{where} of a {hit['source']} output with no floor "
                f"(smallest value on this batch {hit['min']:.3g}): once the {hit['source']} "
                "saturates it gives log(0) = -inf",
                fix=f"use {alt} (or torch.{hit['op']}(p.clamp_min(1e-12)))",
                details={"min": hit["min"]},
            )
        else:
            continue
        if (code, finding.location) not in said:
            said.add((code, finding.location))
            report.findings.append(finding)
    return after


def _loss(model: Any, inputs: Any, targets: Any, loss_fn: Any) -> Any:
    return loss_fn(_call(model, inputs), targets)


def _step(opt: Any, m: Any, batch: Any, loss_fn: Any, *, check: Any = None) -> float:
    """One training step of the copy; returns the loss before it. `check(value)` returning
    False skips the update (the probe stops there)."""
    import torch

    inputs, targets = batch
    if isinstance(opt, torch.optim.LBFGS):  # needs its closure
        seen: list[float] = []

        def closure() -> Any:
            opt.zero_grad(set_to_none=True)
            loss = _loss(m, inputs, targets, loss_fn)
            seen.append(float(loss.detach()))
            loss.backward()
            return loss

        opt.step(closure)
        return seen[0]
    opt.zero_grad(set_to_none=True)
    loss = _loss(m, inputs, targets, loss_fn)
    value = float(loss.detach())
    if math.isfinite(value) and (check is None or check(value)):
        loss.backward()
        opt.step()
    return value


def _overfit(
    model: Any, optimizer: Any, batch: Any, loss_fn: Any, cfg: PreflightConfig,
    lr: float | None = None,
) -> OverfitResult:
    m = copy_model(model).train()
    opt = _fresh_optimizer(optimizer, model, m, lr=lr)
    first = last = math.nan
    for step in range(cfg.overfit_steps):
        last = _step(opt, m, batch, loss_fn)
        if step == 0:
            first = last
        if not math.isfinite(last):
            break
    ok = math.isfinite(last) and last <= cfg.overfit_ratio * first
    return OverfitResult(steps=cfg.overfit_steps, first_loss=first, final_loss=last, success=ok,
                         lr=lr)


def _lr_probe(
    model: Any, optimizer: Any, batch: Any, loss_fn: Any, cfg: PreflightConfig
) -> LRProbeResult:
    m = copy_model(model).train()
    opt = _fresh_optimizer(optimizer, model, m, lr=cfg.lr_min)
    growth = (cfg.lr_max / cfg.lr_min) ** (1 / max(cfg.lr_steps - 1, 1))
    lrs: list[float] = []
    losses: list[float] = []
    best, best_lr, diverge = math.inf, None, None
    lr = cfg.lr_min
    for _ in range(cfg.lr_steps):
        for g in opt.param_groups:
            g["lr"] = lr
        limit = cfg.diverge_factor * best
        value = _step(opt, m, batch, loss_fn, check=lambda v, limit=limit: not v > limit)
        lrs.append(lr)
        losses.append(value)
        if not math.isfinite(value) or value > cfg.diverge_factor * best:
            diverge = lr
            break
        if value < best:
            best, best_lr = value, lr
        lr *= growth
    ref = diverge if diverge is not None else best_lr
    return LRProbeResult(
        lrs=lrs, losses=losses, diverge_lr=diverge, suggested_lr=ref / 10 if ref else None
    )


def _rng_devices() -> list[int]:
    """CUDA devices whose RNG streams must be saved too (only when CUDA is already in use:
    asking would initialise it)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return list(range(torch.cuda.device_count()))
    return []


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
        Findings (init scale, norm eps, sigmoid -> BCE, log without a floor, cannot overfit,
        LR at or above the probe's divergence point), the per-layer init ratios, the overfit
        result, the LR range probe and the time it took.
    """
    import torch

    started = time.monotonic()
    cfg = config or PreflightConfig()
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ValueError("batch must be a pair (inputs, targets)")
    report = PreflightReport(user_lr=user_lr(optimizer))
    with torch.random.fork_rng(devices=_rng_devices()):
        torch.manual_seed(cfg.seed)
        # With grad on: the ops of forward() and the loss, as training runs them.
        with torch.enable_grad():
            after = _forward_check(copy_model(model), batch[0], batch[1], loss_fn, report)
        _init_findings(model, report, after)
        torch.manual_seed(cfg.seed)
        report.lr_probe = _lr_probe(model, optimizer, batch, loss_fn, cfg)
        torch.manual_seed(cfg.seed)
        # At the probe's LR: "cannot overfit" must say the model cannot, not the LR.
        lr = report.lr_probe.suggested_lr
        report.overfit = _overfit(model, optimizer, batch, loss_fn, cfg, lr=lr)
    _result_findings(report, optimizer)
    report.seconds = time.monotonic() - started
    return report


def _result_findings(report: PreflightReport, optimizer: Any) -> None:
    o = report.overfit
    assert o is not None
    if not math.isfinite(o.first_loss):
        report.findings.append(
            AuditFinding(
                code="nonfinite_loss",
                severity="error",
                location="loss_fn",
                message=f"the loss of the untrained model is already {o.first_loss}",
                fix="check the inputs (nanguard scan) and the init",
            )
        )
    elif not o.success:
        report.findings.append(
            AuditFinding(
                code="cannot_overfit",
                severity="warning",
                location="model",
                message=f"loss went {o.first_loss:.4g} -> {o.final_loss:.4g} in {o.steps} steps on "
                "one batch: the model cannot fit even that",
                fix="check labels vs outputs, the loss, frozen parameters, and the LR",
            )
        )
    p = report.lr_probe
    lr_now = report.user_lr
    if p is None or p.diverge_lr is None or lr_now is None or optimizer is None:
        return
    sug = f"{p.suggested_lr:.2g}" if p.suggested_lr else "lower"
    details = {"lr": lr_now, "diverge_lr": p.diverge_lr, "suggested_lr": p.suggested_lr}
    name = type(optimizer).__name__
    if any(f.code == "exploding_init" for f in report.findings):
        # The probe trained the model as initialised: its limit moves once the init is fixed.
        sug += " (measured with the init above: fix that first, then check again)"
    if lr_now >= p.diverge_lr:
        report.findings.append(
            AuditFinding(
                code="optimizer_divergence",
                severity="error",
                location="optimizer",
                message=f"your lr={lr_now:g} ({name}) is above the divergence point "
                f"{p.diverge_lr:.2g} found on this batch; try {sug}",
                fix=f"{name}(..., lr={sug.split()[0]})",
                details=details,
            )
        )
    elif lr_now * LR_NEAR >= p.diverge_lr:
        report.findings.append(
            AuditFinding(
                code="optimizer_divergence",
                severity="warning",
                location="optimizer",
                message=f"your lr={lr_now:g} ({name}) is within {LR_NEAR:g}x of the divergence "
                f"point {p.diverge_lr:.2g} found on this batch; {sug} leaves a margin",
                fix=f"{name}(..., lr={sug.split()[0]}) or a warm-up",
                details=details,
            )
        )
