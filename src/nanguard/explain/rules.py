"""Diagnosis rules: one small unit per cause of the vocabulary (shared/DESIGN.md section 3).

A rule reads an `Evidence` and returns a `Cause` or None. It states what evidence it needs in
its docstring; adding a cause means adding one function here (and a scenario that shows it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from nanguard.explain.evidence import Cause, Evidence

Rule = Callable[[Evidence], "Cause | None"]
RULES: list[Rule] = []

_LOG_OPS = ("aten.log", "aten.log2", "aten.log10", "aten.log1p", "aten.xlogy")
_SINGULAR_OPS = (
    "aten.sqrt",
    "aten.rsqrt",
    "aten.pow",
    "aten.linalg_vector_norm",
    "aten.norm",
    "aten.sqrt_backward",
)
_SOFTMAX_OPS = (
    "aten._softmax",
    "aten.softmax",
    "aten._log_softmax",
    "aten.log_softmax",
    "aten._safe_softmax",
)
_CASCADE = ("spike", "cascade", "forecast", "overflow")
_LOW_PRECISION = ("torch.float16", "torch.bfloat16", "float16", "bfloat16")


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


_SINGULAR_NODES = ("Sqrt", "Rsqrt", "Pow", "Norm", "LinalgVectorNorm")


def _singular_node(ev: Evidence) -> bool:
    """The backward op ran inside the gradient of sqrt / pow / norm (its autograd node)."""
    node = str((ev.first_nonfinite or {}).get("node") or "")
    # Custom autograd Functions count too (e.g. `ClampedSqrtBackward`).
    return any(name in node for name in _SINGULAR_NODES)


def _any_input(ev: Evidence, key: str) -> bool:
    return any(i.get(key) for i in ev.inputs)


def _num(v: object, default: float) -> float:
    """A range bound from the checker (floats, or "nan"/"inf" strings in JSON)."""
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _where(ev: Evidence) -> str:
    f = ev.first_nonfinite or {}
    module = f.get("module")
    at = f" in `{module}`" if module else ""
    return f"{f.get('op') or 'an op'}{at} ({f.get('phase') or '?'} phase, step {f.get('step')})"


_LABEL_KEYS = ("y", "target", "targets", "label", "labels")


_LOSS_OPS = ("aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.huber_loss",
             "aten.nll_loss", "aten.cross_entropy", "aten.binary_cross_entropy", "aten.kl_div")


def _only_targets(ev: Evidence) -> bool:
    """The non-finite value is in the batch's last element (the targets), not the inputs."""
    first = ev.first_nonfinite or {}
    if first.get("module") is None and str(first.get("op") or "").startswith(_LOSS_OPS):
        return True  # first consumed by the loss, outside every module: not a model input
    if ev.bad_tensors:
        return ev.n_batch_tensors > 1 and ev.bad_tensors == [ev.n_batch_tensors - 1]
    item = str((ev.first_nonfinite or {}).get("batch_item") or "")  # e.g. "[1]" or "['y']"
    key = item.strip("[]'\"")
    if key in _LABEL_KEYS:
        return True
    return key.isdigit() and ev.n_batch_tensors > 1 and int(key) == ev.n_batch_tensors - 1


@rule
def data_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `data`, and which batch tensors hold the value (inputs, not only targets)."""
    if ev.phase != "data":
        return None
    if _only_targets(ev):
        return None  # only the targets: label_nonfinite
    samples = (ev.first_nonfinite or {}).get("samples") or []
    return Cause(
        cause="data_nonfinite",
        confidence=0.95,
        evidence=f"the batch at step {ev.step} already holds NaN/Inf in its inputs, "
        f"samples {samples[:8]}, before any op ran",
        fix="drop or repair those rows at load time; find all of them with "
        "`nanguard scan <your data file>` (or nanguard.audit.scan_dataset(dataset))",
    )


@rule
def label_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `data` with only the last batch tensor (the targets) non-finite."""
    if ev.phase != "data" or not _only_targets(ev):
        return None
    samples = (ev.first_nonfinite or {}).get("samples") or []
    return Cause(
        cause="label_nonfinite",
        confidence=0.95,
        evidence=f"the targets of step {ev.step} hold NaN/Inf (samples {samples[:8]}); "
        "the inputs are finite",
        fix="fix or drop those labels; `nanguard scan <data> --label <column>` lists every row",
    )


@rule
def log_of_nonpositive(ev: Evidence) -> Cause | None:
    """Needs: origin op a log, ideally its input range (zero or negative values)."""
    if not ev.op.startswith(_LOG_OPS) or ev.phase == "backward":
        return None
    zero = _any_input(ev, "has_zero")
    neg = _any_input(ev, "has_negative")
    what = "zeros" if zero else "negative values" if neg else "values <= 0"
    return Cause(
        cause="log_of_nonpositive",
        confidence=0.9 if (zero or neg) else 0.75,
        evidence=f"{_where(ev)} received {what}",
        fix="`torch.log(p.clamp_min(1e-12))`, or stay in log space "
        "(`F.logsigmoid`, `F.log_softmax`, `F.binary_cross_entropy_with_logits`)",
    )


@rule
def saturated_loss(ev: Evidence) -> Cause | None:
    """Needs: origin op binary_cross_entropy / a log in the loss phase fed by a saturated prob."""
    if "binary_cross_entropy" in ev.op and "with_logits" not in ev.op:
        conf = 0.9
    elif ev.op.startswith(_LOG_OPS) and ev.phase == "loss":
        # A log in the loss whose input is a probability (within [0, 1]) hitting 0: a sigmoid
        # or softmax saturated before the log — ranks above the generic log_of_nonpositive.
        probability = bool(ev.inputs) and all(
            _num(i.get("min"), -1.0) >= 0.0 and _num(i.get("max"), 2.0) <= 1.0 for i in ev.inputs
        )
        conf = 0.92 if probability else 0.6
    else:
        return None
    return Cause(
        cause="saturated_loss",
        confidence=conf,
        evidence=f"{_where(ev)}: a probability saturated at 0 or 1 before the loss took its log",
        fix="`F.binary_cross_entropy(torch.sigmoid(z), y)` -> "
        "`F.binary_cross_entropy_with_logits(z, y)`; `softmax` then `log` -> `log_softmax`",
    )


@rule
def division_by_zero(ev: Evidence) -> Cause | None:
    """Needs: origin op a division whose denominator holds zeros."""
    if not ev.op.startswith(("aten.div", "aten.reciprocal", "aten._foreach_div")):
        return None
    if ev.phase == "optimizer" or _singular_node(ev):
        return None  # optimizer_state_nonfinite / singular_gradient explain it better
    zero = len(ev.inputs) > 1 and bool(ev.inputs[1].get("has_zero"))
    if not zero and ev.phase == "backward":
        return None  # singular_gradient
    return Cause(
        cause="division_by_zero",
        confidence=0.85 if zero else 0.6,
        evidence=f"{_where(ev)} divided by " + ("zero" if zero else "a value at or near zero"),
        fix="add an eps to the denominator: `x / (std + 1e-5)` or `x / d.clamp_min(1e-12)`",
    )


@rule
def singular_gradient(ev: Evidence) -> Cause | None:
    """Needs: phase backward, origin op of sqrt/pow/norm (or the div/mul inside its backward)."""
    if ev.phase != "backward":
        return None
    fwd = str((ev.first_nonfinite or {}).get("forward_op") or "")
    if not (
        ev.op.startswith(_SINGULAR_OPS)
        or fwd.startswith(_SINGULAR_OPS)
        or _singular_node(ev)
        or ev.op.startswith(("aten.div", "aten.mul", "aten.reciprocal"))
    ):
        return None
    return Cause(
        cause="singular_gradient",
        confidence=0.9 if _singular_node(ev) else 0.7,
        evidence=f"{_where(ev)}: the forward was finite, its gradient is not — sqrt / norm / "
        "pow(x, p<1) at exactly 0 have an infinite derivative",
        fix="`torch.sqrt(x + 1e-12)`; for a norm, `torch.sqrt((v * v).sum(-1) + 1e-12)`",
    )


@rule
def masked_softmax(ev: Evidence) -> Cause | None:
    """Needs: origin op a softmax (its input has a row of only -inf)."""
    if not ev.op.startswith(_SOFTMAX_OPS):
        return None
    return Cause(
        cause="masked_softmax",
        confidence=0.9,
        evidence=f"{_where(ev)}: a row whose every entry is masked to -inf gives 0/0 = NaN",
        fix="keep at least one unmasked position per row (e.g. let padding attend to itself), "
        "or fill with `torch.finfo(dtype).min` instead of -inf and zero the output rows",
    )


@rule
def exp_overflow(ev: Evidence) -> Cause | None:
    """Needs: origin op exp (finite input large enough to overflow)."""
    if not ev.op.startswith(("aten.exp", "aten.expm1")):
        return None
    return Cause(
        cause="exp_overflow",
        confidence=0.9,
        evidence=f"{_where(ev)}: exp of a finite input above ~88 overflows float32",
        fix="subtract the max first: `torch.softmax(x, dim)` / `torch.logsumexp`, or "
        "`(x - x.amax(dim, keepdim=True)).exp()`",
    )


@rule
def low_precision_overflow(ev: Evidence) -> Cause | None:
    """Needs: a reduced-precision dtype and an overflow from finite inputs in forward."""
    if ev.dtype not in _LOW_PRECISION or ev.phase not in ("forward", "loss"):
        return None
    return Cause(
        cause="low_precision_overflow",
        confidence=0.8,
        evidence=f"{_where(ev)} overflowed {ev.dtype} (largest value 65504 for float16)",
        fix="use bfloat16 instead of float16, keep this op in float32 "
        "(`with torch.autocast(..., enabled=False): ...x.float()`), or use a GradScaler",
    )


@rule
def optimizer_state_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase optimizer with finite gradients (the update itself made the value)."""
    if ev.phase != "optimizer":
        return None
    if ev.warnings_before(_CASCADE):
        return None  # a cascade that overflowed in the update: optimizer_divergence
    eps_note = " with eps=0" if ev.eps == 0 else ""
    param = (ev.first_nonfinite or {}).get("param") or (ev.first_nonfinite or {}).get("module")
    return Cause(
        cause="optimizer_state_nonfinite",
        confidence=0.85 if ev.eps == 0 else 0.6,
        evidence=f"gradients were finite but {ev.optimizer or 'the optimizer'}{eps_note} "
        f"produced a non-finite update / state for `{param}` at step {ev.step}",
        fix="`torch.optim.Adam(params, eps=1e-8)` (never 0); check `nanguard audit` on the "
        "optimizer state of your checkpoint",
    )


@rule
def optimizer_divergence(ev: Evidence) -> Cause | None:
    """Needs: spike / cascade / forecast alarms shortly before the failure (or without one)."""
    warn = ev.warnings_before(_CASCADE)
    if not warn or ev.phase == "data":
        return None
    spikes = [a for a in warn if a["kind"] == "spike" and math.isfinite(float(a["value"]))]
    healthy = ev.healthy_grad_norm
    growth = ""
    factor = 10.0
    if spikes and healthy:
        ratio = float(spikes[0]["value"]) / healthy
        growth = f"; the first spike was {ratio:.3g}x the healthy grad norm {healthy:.3g}"
        factor = min(max(2.0, round(math.log10(max(ratio, 1.0)) * 3)), 10.0)
    lr = f"lr={ev.lr:g}" if ev.lr is not None else "the LR"
    new_lr = f"lr={ev.lr / factor:.3g}" if ev.lr is not None else f"LR / {factor:g}"
    clip = f"{3 * healthy:.3g}" if healthy else "~3x the typical grad norm"
    mom = f" with momentum {ev.momentum:g}" if ev.momentum else ""
    kinds = ", ".join(sorted({a["kind"] for a in warn}))
    return Cause(
        cause="optimizer_divergence",
        confidence=0.85 if ev.step is not None else 0.6,
        evidence=f"{kinds} alarms from step {warn[0]['step']}: {ev.optimizer or 'the optimizer'}"
        f"{mom} at {lr} amplified a gradient spike step after step{growth}",
        fix=f"lower the LR ({lr} -> {new_lr}), clip: "
        f"`torch.nn.utils.clip_grad_norm_(model.parameters(), {clip})`, and add a warm-up; "
        "or let nanguard recover: `Guard(..., policy='rollback')`",
    )


@rule
def exploding_init(ev: Evidence) -> Cause | None:
    """Needs: a forward overflow within the first few steps, before any cascade."""
    if ev.step is None or ev.step > 2 or ev.phase not in ("forward", "loss"):
        return None
    if ev.warnings_before(("spike", "cascade")):
        return None
    return Cause(
        cause="exploding_init",
        confidence=0.7,
        evidence=f"activations overflowed at step {ev.step}, before training could move the "
        f"weights: {_where(ev)}",
        fix="use the default init or `nn.init.kaiming_normal_(w, nonlinearity='relu')` "
        "(std = gain / sqrt(fan_in)); check with `nanguard.preflight(model, batch, ...)`",
    )


@rule
def bad_batch(ev: Evidence) -> Cause | None:
    """Needs: a spike alarm on a run that never went non-finite."""
    if ev.first_nonfinite is not None:
        return None
    spikes = [a for a in ev.alarms if a["kind"] == "spike"]
    if not spikes:
        return None
    steps = sorted({a["step"] for a in spikes})
    return Cause(
        cause="bad_batch",
        confidence=0.5,
        evidence=f"gradient spikes at steps {steps[:6]} without a NaN: finite but extreme samples",
        fix="look up those steps' batch fingerprints in run.db (table `batches`) and scan the "
        "data (`nanguard scan`); clip the grad norm",
    )


@rule
def vanishing_gradients(ev: Evidence) -> Cause | None:
    """Needs: a vanishing alarm."""
    alarms = [a for a in ev.alarms if a["kind"] == "vanishing"]
    if not alarms:
        return None
    return Cause(
        cause="vanishing_gradients",
        confidence=0.6,
        evidence=alarms[0]["message"],
        fix="check for dead ReLUs (use LeakyReLU/GELU), saturated sigmoids/tanh, a too small "
        "init, or a detach() that cuts the graph; add residual connections or normalization",
    )


@rule
def nondeterministic(ev: Evidence) -> Cause | None:
    """Needs: a replay that did not reproduce the failure bit for bit."""
    if ev.reproduced is not False:
        return None
    return Cause(
        cause="nondeterministic",
        confidence=0.7,
        evidence="replaying the failing step from the same state, RNG and batch did not give "
        "the same result",
        fix="suspect hardware or a race: rerun with `torch.use_deterministic_algorithms(True)`; "
        "if it still differs, test the device (memory errors, a faulty GPU)",
    )
