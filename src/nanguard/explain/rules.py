"""Diagnosis rules: one small unit per cause of the vocabulary (shared/DESIGN.md section 3).

A rule reads an `Evidence` and returns a `Cause` or None. Its docstring says what evidence it
needs and what rules it out; where a piece of evidence is missing (no op-level replay, no
activation watching) it fires with a lower confidence and its evidence text says what is
missing, rather than claiming what it cannot see. Adding a cause means adding one function here
(with a positive and a negative test in tests/explain/).

Fixes use the run's own numbers (LR, healthy grad norm, the growth it measured) and the user's
entry point (`Evidence.entry`: a `Guard(...)` option for `api` users, a `nanguard run` flag for
zero-code users).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import median
from typing import Any

import torch

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

HUGE = 1e6
"""An activation abs-max or a grad norm this large is far beyond a healthy network's (O(1) to
O(1e3)), whatever the dtype: what an exploding init or a diverging optimizer shows."""
JUMP = 100.0
"""Growth of the loss or grad norm in one step that counts as a jump (not noise)."""
EARLY = 10
"""With a preflight that measured the init too large, a failure up to this step can still be
the init's (its huge gradients make the first updates explode: the jump is its symptom)."""


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


# Autograd nodes whose backward is singular at 0 (custom Functions count: `ClampedSqrtBackward`).
_SINGULAR_NODES = ("Sqrt", "Pow", "Norm", "Dist")
# ... but normalization layers are not: their backward has an eps and no singular point.
_NORM_LAYERS = ("LayerNorm", "BatchNorm", "GroupNorm", "InstanceNorm", "RmsNorm", "RMSNorm",
                "WeightNorm", "LocalResponseNorm")


def _node(ev: Evidence) -> str:
    return str((ev.first_nonfinite or {}).get("node") or "")


def _singular_node(ev: Evidence) -> bool:
    """The backward op ran inside the gradient of sqrt / rsqrt / pow / a norm (its autograd
    node), not inside a normalization layer's (LayerNorm & co. divide by sqrt(var + eps))."""
    node = _node(ev)
    if any(layer in node for layer in _NORM_LAYERS):
        return False
    return any(name in node for name in _SINGULAR_NODES)


def _any_input(ev: Evidence, key: str) -> bool:
    return any(i.get(key) for i in ev.inputs)


def _num(v: object, default: float) -> float:
    """A range bound from the checker (floats, or "nan"/"inf" strings in JSON)."""
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return default


def _finfo(dtype: object) -> torch.finfo:
    name = str(dtype or "float32").replace("torch.", "")
    try:
        return torch.finfo(getattr(torch, name))
    except (AttributeError, TypeError):
        return torch.finfo(torch.float32)


def _overflow_scale(dtype: object) -> float:
    """Inputs this large (about sqrt of the dtype's largest value) overflow when multiplied:
    the signature of an overflow of huge finite magnitudes, not of a singular point."""
    return max(_finfo(dtype).max ** 0.5 / 100, 1e3)


def _near_zero(r: dict[str, Any]) -> str | None:
    """`zero` when the input range holds an exact 0, `tiny` when its smallest |value| (known
    when the range does not straddle 0) is within rounding of 0 for its dtype, else None."""
    if r.get("has_zero"):
        return "zero"
    lo, hi = _num(r.get("min"), math.nan), _num(r.get("max"), math.nan)
    closest = lo if lo >= 0 else -hi if hi <= 0 else math.nan
    if math.isfinite(closest) and closest <= _finfo(r.get("dtype")).tiny ** 0.5:
        return "tiny"
    return None


def _singular_input(ev: Evidence) -> tuple[str, str]:
    """Whether the origin op's input at the singular point is at (or within rounding of) it:
    (`zero` | `tiny` | `no` | `missing`, a phrase for the evidence text). For a division the
    denominator is looked at, for pow / sqrt / rsqrt / norm the base, else any input."""
    ins = ev.inputs
    if not ins:
        return "missing", "the origin op's input ranges were not recorded (no op-level replay)"
    if ev.op.startswith("aten.div") and len(ins) > 1:
        looked, what = [ins[1]], "the denominator"
    elif ev.op.startswith(("aten.reciprocal", *_SINGULAR_OPS)):
        looked, what = [ins[0]], "the input"
    else:
        looked, what = ins, "an input"
    for r in looked:
        near = _near_zero(r)
        if near == "zero":
            return "zero", f"{what} holds exact zeros"
        if near == "tiny":
            return "tiny", f"{what} holds values within rounding of 0 (min {r.get('min')})"
    return "no", f"no input is at or near 0 (largest |input| {_fmt(ev.magnitude)})"


def _fmt(v: float | None) -> str:
    return "?" if v is None else f"{v:.3g}"


def _where(ev: Evidence) -> str:
    f = ev.first_nonfinite or {}
    module = f.get("module")
    at = f" in `{module}`" if module else ""
    return f"{f.get('op') or 'an op'}{at} ({f.get('phase') or '?'} phase, step {f.get('step')})"


def _rollback(ev: Evidence) -> str:
    """The fix's last clause: how this user turns on nanguard's own recovery, or, when a
    recovery policy already acted in this run, that it did (not a second proposal)."""
    done = sorted({str(a.get("action")) for a in ev.actions} & set(_RECOVERY))
    if done:
        return f"nanguard's recovery acted in this run ({', '.join(done)}: see its actions)"
    if ev.entry == "run":
        return "or let nanguard recover: `nanguard run --policy rollback <your script> ...`"
    return "or let nanguard recover: `Guard(..., policy='rollback')`"


_RECOVERY = ("skip", "rollback", "heal_clip", "wd_cut", "lr_cut")
"""Actions of nanguard's recovery policies (report.json `actions`; `record.runlog.RECOVERING`)."""


def _healed_lr(ev: Evidence) -> tuple[int, float] | None:
    """(number of `heal` LR cuts, the LR the last recorded step used) when heal cut the LR
    during the run: the LR the run went on at, measured, not derived from the cut's text."""
    cuts = sum(1 for a in ev.actions if a.get("action") == "lr_cut")
    if not cuts:
        return None
    for h in sorted(ev.history, key=lambda h: h.get("step", 0), reverse=True):
        lr = _num(h.get("lr"), math.nan)
        if math.isfinite(lr) and lr > 0:
            return cuts, lr
    return None


def _batch_evidence(ev: Evidence) -> bool:
    """The batch itself is shown to hold the value: rows of it (`samples`), the guard's
    non-finite batch tensors, or the op checker's batch element (`batch_item`); and it is not
    a value the guard found in the loaded state (`tensors`, see checkpoint_nonfinite)."""
    first = ev.first_nonfinite or {}
    if first.get("tensors"):
        return False
    return bool(ev.bad_tensors or first.get("batch_item") or first.get("samples"))


def _jump(ev: Evidence) -> dict[str, Any] | None:
    """The first one-step growth of the loss or grad norm by >= `JUMP` (finite values, after
    an update) in the steps up to the failure: `step` (where it showed), `from`, `signal`,
    `before`, `after`, `ratio`, and `growth` (the per-step growth of the error it implies: the
    grad norm's ratio, or the square root of a loss ratio)."""
    steps = sorted(ev.steps_until_failure(), key=lambda h: h.get("step", 0))
    for a, b in zip(steps, steps[1:], strict=False):
        found: list[tuple[float, dict[str, Any]]] = []
        for signal, floor in (("grad_norm", 0.0), ("loss", 1e-3)):
            x, y = _num(a.get(signal), math.nan), _num(b.get(signal), math.nan)
            if math.isfinite(x) and math.isfinite(y) and abs(x) > floor and y / x >= JUMP:
                ratio = y / x
                growth = ratio if signal == "grad_norm" else math.sqrt(ratio)
                found.append((growth, {"step": b.get("step"), "from": a.get("step"),
                                       "signal": signal, "before": x, "after": y,
                                       "ratio": ratio, "growth": growth}))
        if found:
            best = max(found, key=lambda f: f[0])[1]
            best["others"] = [f[1] for f in found if f[1] is not best]
            return best
    return None


BIG_UPDATE = 0.5
"""An update at least half the size of the weights it changes (`update_ratio`, measured
against the weights after it): ordinary training moves them ~1e-4 to ~1e-2 of their norm a
step (a healthy small VAE under Adam at lr 1e-2: 0.12 at its first step, 0.03 ten steps
later); this replaces them."""

BIG_UPDATE_WINDOW = 10
"""How many steps before the failure such an update counts: update ratios are sampled every
`WatchConfig.update_ratio_every` (10) steps, step 0 always."""


def _big_update(ev: Evidence) -> dict[str, Any] | None:
    """The first measured update at most `BIG_UPDATE_WINDOW` steps before the failing step
    that moved the weights by at least `BIG_UPDATE` of their norm: {step, ratio}, else None.
    A ratio of exactly 1 says the weights were all zero before it (a zero-initialised model's
    first update), not that the update was large: it does not count."""
    if ev.step is None:
        return None
    for h in sorted(ev.history, key=lambda h: h.get("step", 0)):
        s = h.get("step", 0)
        r = _num(h.get("update_ratio"), math.nan)
        if (0 <= ev.step - s - 1 < BIG_UPDATE_WINDOW and math.isfinite(r) and r >= BIG_UPDATE
                and r != 1.0):
            return {"step": s, "ratio": r}
    return None


def _healthy_grad_norm(ev: Evidence, before: int | None = None) -> float | None:
    """The median finite grad norm of the recorded steps before step `before` (the jump), else
    the guard's healthy median, else the median of all recorded steps."""
    norms = [_num(h.get("grad_norm"), math.nan) for h in ev.steps_until_failure()
             if before is None or h.get("step", 0) < before]
    norms = [n for n in norms if math.isfinite(n) and n > 0]
    if before is not None and norms:
        return median(norms)  # the detector's median may include the jump's first steps
    if ev.healthy_grad_norm:
        return ev.healthy_grad_norm
    return median(norms) if norms else None


def _early_magnitude(ev: Evidence) -> tuple[bool | None, str]:
    """Huge activations / grad norms in steps 0-2 (up to the failure): (True: seen, False:
    measured and not huge, None: nothing measured), with the evidence phrase."""
    measured: list[str] = []
    for h in ev.steps_until_failure():
        if h.get("step", 99) > 2:
            continue
        for signal, label in (("act_max", "activation abs-max"), ("grad_norm", "grad norm")):
            v = _num(h.get(signal), math.nan)
            if math.isfinite(v):
                if v >= HUGE:
                    return True, f"{label} {v:.3g} at step {h['step']}"
                measured.append(signal)
    for a in ev.alarms:
        if a.get("kind") in ("overflow", "forecast") and a.get("step", 99) <= 2:
            return True, f"{a['kind']} alarm at step {a['step']}: {a.get('message', '')}"
    top = ev.magnitude
    if top is not None:
        if top >= HUGE:
            return True, f"inputs of {ev.op} as large as {top:.3g}"
        measured.append("inputs")
    if measured:
        return False, ""
    return None, ""


def _preflight_init(ev: Evidence) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The layers the preflight flagged as initialised too large, and the one the failure is
    in: the failing module itself (names may carry a prefix: several roots), else the first
    flagged layer inside it."""
    flagged = [f for f in (ev.preflight or {}).get("findings") or []
               if f.get("code") == "exploding_init"]
    module = str((ev.first_nonfinite or {}).get("module") or "")
    if not module:
        return flagged, None
    for f in flagged:
        name = str(f.get("location") or "")
        if name and (module == name or module.endswith("." + name)):
            return flagged, f
    for f in flagged:
        name = str(f.get("location") or "")
        if name.startswith(module + ".") or module.endswith("." + name.split(".")[0]):
            return flagged, f
    return flagged, None


def _layer_text(f: dict[str, Any]) -> str:
    d = f.get("details") or {}
    return (f"`{f.get('location')}`: weight std {_num(d.get('std'), math.nan):.3g} = "
            f"{_num(d.get('ratio'), math.nan):.3g}x 1/sqrt(fan_in)")


def _untrained_loss(ev: Evidence) -> float | None:
    pf = ev.preflight or {}
    v = _num((pf.get("overfit") or {}).get("first_loss"), math.nan)
    return v if math.isfinite(v) else None


# ---------------------------------------------------------------------- where it came from


def _before_first_update(ev: Evidence) -> tuple[str, float] | None:
    """A value non-finite before the first update that no op made: (`found`: the guard's
    check of the state found `tensors`; `state`: the checker met a non-finite parameter at
    step 0; `unexplained`: step 0, phase `data`, no batch evidence), with a confidence."""
    first = ev.first_nonfinite or {}
    if ev.phase == "checkpoint" or first.get("tensors"):
        # `tensors` is the guard's checkpoint finding; a replay may have rewritten the phase.
        return "found", 0.97
    if ev.step == 0 and first.get("kind") == "state":
        return "state", 0.8
    if ev.step == 0 and ev.phase == "data" and not _batch_evidence(ev):
        return "unexplained", 0.6
    return None


def _state_tensors(ev: Evidence) -> list[str]:
    first = ev.first_nonfinite or {}
    tensors = [str(t) for t in first.get("tensors") or []]
    if not tensors and first.get("param"):
        tensors = [str(first["param"])]
    return tensors


@rule
def checkpoint_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `checkpoint` (weights, optimizer state or buffers already non-finite at the
    guard's first step, before any update), with `tensors` (their names) and `source` (the
    `file.py:LINE` of the load call, None when unknown); `tensors` alone counts too (a replay
    may have rewritten phase and source). Weaker, at step 0 only: a `state` value (a
    parameter the replay found non-finite before any op made it), or a `data` phase with no
    evidence that the batch holds the value.
    The event it needs: state was loaded (`Evidence.loaded` True, or unknown for a `Guard`
    created after a load).

    Ruled out: no load anywhere in the script (`nanguard run` tracks every `torch.load` /
    `load_state_dict`: init_nonfinite), the weaker forms after step 0 (an update may have
    made the value), and whenever the batch is shown to hold the value (data_nonfinite)."""
    found = _before_first_update(ev)
    if found is None or ev.loaded is False:
        return None
    form, conf = found
    first = ev.first_nonfinite or {}
    tensors = _state_tensors(ev)
    load = first.get("load_source") or (first.get("source") if ev.phase == "checkpoint"
                                         else None)
    if form == "found" and ev.phase != "checkpoint" and not first.get("load_source"):
        load = None  # `source` now names the replayed op's line, not the load call
    named = ", ".join(f"`{t}`" for t in tensors[:6]) + (" ..." if len(tensors) > 6 else "")
    what = named or "a tensor the batch does not hold"
    were = "were" if len(tensors) > 1 else "was"
    loaded = f"the state loaded at {load}" if load else (
        "loaded state (the load call's line is unknown)")
    if form == "found":
        evidence = (f"{what} {were} already non-finite at step {ev.step}, before the first "
                    f"update: {'they' if len(tensors) > 1 else 'it'} came with {loaded}")
    elif form == "state":
        evidence = (f"{what} {were} non-finite at step {ev.step} before any op made "
                    f"{'them' if len(tensors) > 1 else 'it'} and before the first update: "
                    f"{loaded}, presumably")
    else:
        evidence = (f"a value was non-finite at step {ev.step} although no batch tensor or row "
                    "is shown to hold it and no op made it (no tensor name recorded): "
                    f"{loaded}, presumably")
    ckpt = first.get("checkpoint") or "CKPT"
    fix = (f"`nanguard audit {ckpt}` lists every non-finite tensor of the checkpoint; resume "
           "from an earlier checkpoint (the last one saved before the run went non-finite)")
    if tensors and all(t.startswith("optimizer") for t in tensors):
        fix += ", or load the model weights only and start the optimizer state fresh"
    elif tensors and all(t.startswith("buffer:") for t in tensors):
        fix += ", or reset those buffers (BatchNorm: `module.reset_running_stats()`)"
    return Cause(
        cause="checkpoint_nonfinite",
        confidence=conf,
        evidence=evidence,
        fix=fix,
    )


@rule
def init_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: a parameter, optimizer-state tensor or buffer non-finite before the first
    update that no op made (the guard's check of the state, or the checker at step 0), AND no
    load anywhere in the script (`Evidence.loaded` False: `nanguard run` tracked every
    `torch.load` / `load_state_dict`): the script's own initialisation made it.
    Ruled out: a load seen or not knowable (checkpoint_nonfinite), no tensor named (a value
    that may be the batch's), the batch shown to hold the value (data_nonfinite)."""
    found = _before_first_update(ev)
    tensors = _state_tensors(ev)
    if found is None or found[0] == "unexplained" or ev.loaded is not False or not tensors:
        return None
    named = ", ".join(f"`{t}`" for t in tensors[:6]) + (" ..." if len(tensors) > 6 else "")
    were = "were" if len(tensors) > 1 else "was"
    module = (ev.first_nonfinite or {}).get("module")
    where = f" of `{module}`" if module else ""
    return Cause(
        cause="init_nonfinite",
        confidence=0.9 if found[0] == "found" else 0.75,
        evidence=f"{named} {were} non-finite at step {ev.step}, before any update, and the "
        "script loaded no state (no `torch.load` / `load_state_dict` call anywhere): its own "
        "initialisation made the value",
        fix=f"look at the initialisation{where} (a custom `reset_parameters`, `nn.init` call "
        "or in-place write to the weights); "
        + ("`nanguard run --preflight-only <your script> ...`" if ev.entry == "run"
           else "`nanguard preflight`")
        + " checks every layer's init before training",
    )


_LABEL_KEYS = ("y", "target", "targets", "label", "labels")


_LOSS_OPS = ("aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.huber_loss",
             "aten.nll_loss", "aten.cross_entropy", "aten.binary_cross_entropy", "aten.kl_div")


def _only_targets(ev: Evidence) -> bool:
    """The non-finite value is in the batch's last element (the targets), not the inputs."""
    first = ev.first_nonfinite or {}
    if ev.bad_tensors:  # the guard read the batch tensors themselves
        return ev.n_batch_tensors > 1 and ev.bad_tensors == [ev.n_batch_tensors - 1]
    if first.get("module") is None and str(first.get("op") or "").startswith(_LOSS_OPS):
        return True  # first consumed by the loss, outside every module: not a model input
    item = str((ev.first_nonfinite or {}).get("batch_item") or "")  # e.g. "[1]" or "['y']"
    key = item.strip("[]'\"")
    if key in _LABEL_KEYS:
        return True
    return key.isdigit() and ev.n_batch_tensors > 1 and int(key) == ev.n_batch_tensors - 1


def _batch_held(ev: Evidence) -> bool:
    """The batch held the value before the step: phase `data` with evidence that the batch
    holds it (`_batch_evidence`), or, whatever op first touched it and in whichever phase the
    origin was put, the guard's own check of the batch found non-finite batch tensors."""
    if ev.phase == "data":
        return _batch_evidence(ev)
    return bool(ev.bad_tensors) and not (ev.first_nonfinite or {}).get("tensors")


def _first_reader(ev: Evidence) -> str:
    """`; {op} ({phase}) only read it first` when the origin names another phase than data."""
    if ev.phase in ("data", "") or not ev.op:
        return ""
    return f"; {_where(ev)} was only the first op to read it"


@rule
def data_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `data` and evidence that the batch holds the value: its rows (`samples`),
    the guard's non-finite batch tensors, or the checker's batch element (`batch_item`); or, in
    any phase, the guard's non-finite batch tensors (the batch held the value whichever op
    first touched it: a collate `stack`, `.float()`, the first layer).
    Ruled out: no such evidence (samples [] and no bad batch tensor: e.g. a loaded tensor,
    see checkpoint_nonfinite), or a watched batch found finite; only the targets
    (label_nonfinite)."""
    if not _batch_held(ev):
        return None
    if _only_targets(ev):
        return None  # only the targets: label_nonfinite
    samples = (ev.first_nonfinite or {}).get("samples") or []
    rows = f"samples {samples[:8]}" if samples else "rows unknown"
    return Cause(
        cause="data_nonfinite",
        confidence=0.95,
        evidence=f"the batch at step {ev.step} already holds NaN/Inf in its inputs ({rows}), "
        f"before any op computed on it{_first_reader(ev)}",
        fix="drop or repair those rows at load time; find all of them with "
        "`nanguard scan <your data file>`"
        + (" (or nanguard.audit.scan_dataset(dataset))" if ev.entry != "run" else ""),
    )


@rule
def label_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: evidence that the batch holds the value (as data_nonfinite), and only the last
    batch tensor (the targets) non-finite. Ruled out: inputs non-finite too."""
    if not _batch_held(ev) or not _only_targets(ev):
        return None
    samples = (ev.first_nonfinite or {}).get("samples") or []
    return Cause(
        cause="label_nonfinite",
        confidence=0.95,
        evidence=f"the targets of step {ev.step} hold NaN/Inf (samples {samples[:8]}); "
        f"the inputs are finite{_first_reader(ev)}",
        fix="fix or drop those labels; `nanguard scan <data> --label <column>` lists every row",
    )


# ---------------------------------------------------------------------- ops at a bad point


@rule
def log_of_nonpositive(ev: Evidence) -> Cause | None:
    """Needs: origin op a log (not in backward) and its input range holding zeros or negative
    values. Ruled out: input ranges with neither. Without input ranges it fires lower, saying
    so."""
    if not ev.op.startswith(_LOG_OPS) or ev.phase == "backward":
        return None
    zero = _any_input(ev, "has_zero")
    neg = _any_input(ev, "has_negative")
    if ev.inputs and not (zero or neg):
        return None
    what = "zeros" if zero else "negative values" if neg else "values <= 0"
    missing = "" if ev.inputs else " (presumably: its input ranges were not recorded)"
    return Cause(
        cause="log_of_nonpositive",
        confidence=0.9 if (zero or neg) else 0.6,
        evidence=f"{_where(ev)} received {what}{missing}",
        fix="`torch.log(p.clamp_min(1e-12))`, or stay in log space "
        "(`F.logsigmoid`, `F.log_softmax`, `F.binary_cross_entropy_with_logits`)",
    )


def _probability(ev: Evidence) -> bool:
    """Every input of the op lies within [0, 1] and one of them touches 0: a probability that
    rounded to exactly 0 (or 1, before `1 - p`)."""
    return bool(ev.inputs) and _any_input(ev, "has_zero") and all(
        _num(i.get("min"), -1.0) >= 0.0 and _num(i.get("max"), 2.0) <= 1.0 for i in ev.inputs
    )


@rule
def saturated_loss(ev: Evidence) -> Cause | None:
    """Needs: origin op binary_cross_entropy (not with logits), or a log in the loss phase
    (raw-tensor code without modules counts as loss) whose input is a probability that
    saturated to 0 (all inputs within [0, 1], a zero among them). Ruled out: a log in the
    model's forward (log_of_nonpositive), a log input outside [0, 1]. A `saturation` warning
    before the failure (the sampled probe saw probabilities a log consumes creep to within
    rounding of 0 / 1) confirms it where the input range was not recorded."""
    warned = [a for a in ev.alarms if a.get("kind") == "saturation"]
    if "binary_cross_entropy" in ev.op and "with_logits" not in ev.op:
        conf = 0.9
        what = "a probability saturated at 0 or 1 before the loss took its log"
    elif ev.op.startswith(_LOG_OPS) and ev.phase == "loss":
        if _probability(ev):
            # Ranks above the generic log_of_nonpositive: a sigmoid / softmax saturated.
            conf = 0.92
            what = ("its input is a probability (within [0, 1]) that rounded to exactly 0: "
                    "a sigmoid / softmax saturated before the log")
        elif not ev.inputs and warned:
            conf = 0.9
            what = "a log in the loss, after the saturation probe's warning"
        elif not ev.inputs:
            conf = 0.6
            what = ("a log in the loss; its input range was not recorded, so a saturated "
                    "probability is only presumed")
        else:
            return None
    else:
        return None
    if warned:
        what += (f"; the saturation probe warned from step {warned[0]['step']}: "
                 f"{warned[0]['message'].split(';')[0]}")
    return Cause(
        cause="saturated_loss",
        confidence=conf,
        evidence=f"{_where(ev)}: {what}",
        fix="`F.binary_cross_entropy(torch.sigmoid(z), y)` -> "
        "`F.binary_cross_entropy_with_logits(z, y)`; `softmax` then `log` -> `log_softmax`; "
        "hand-written `-(y*log(h) + (1-y)*log(1-h))` with `h = sigmoid(z)` -> "
        "`F.binary_cross_entropy_with_logits(z, y)` (or `F.logsigmoid(z)`, `F.logsigmoid(-z)`)",
    )


def _empty_input(ev: Evidence) -> dict[str, Any] | None:
    """The origin op's first input with no elements (a dimension of size 0), when its output
    is NaN: a reduction over nothing (a mean, a loss averaged over an empty selection)."""
    out = (ev.first_nonfinite or {}).get("output") or {}
    if not out.get("nan"):
        return None
    return next((i for i in ev.inputs
                 if isinstance(i.get("shape"), list) and 0 in i["shape"]), None)


def _empty_reduction(ev: Evidence, empty: dict[str, Any]) -> Cause:
    shape = empty.get("shape")
    rows = " (0 rows)" if shape and shape[0] == 0 else ""
    return Cause(
        cause="division_by_zero",
        confidence=0.85,
        evidence=f"{_where(ev)} reduced an empty tensor: input shape {shape}{rows}; the mean "
        "over no elements is 0 / 0 (an empty selection or split of the batch)",
        fix="skip the term when the selection is empty (`if mask.any(): ...`), or average "
        "over a count that cannot be 0: `(per_item * mask).sum() / mask.sum().clamp_min(1)`; "
        "for an empty split, check its size before training on it",
    )


@rule
def division_by_zero(ev: Evidence) -> Cause | None:
    """Needs: origin op a division (not in the optimizer, not inside a singular node's
    backward) whose denominator holds zeros or values within rounding of 0; or any op that
    made a NaN out of an input with no elements (a mean or a loss over an empty selection:
    0 / 0). Ruled out: a denominator range away from 0 (a huge numerator overflowed instead),
    an empty input with a finite or Inf output. Without input ranges it fires lower (not in
    backward: singular_gradient), saying so."""
    if ev.phase != "optimizer" and (empty := _empty_input(ev)) is not None:
        return _empty_reduction(ev, empty)
    if not ev.op.startswith(("aten.div", "aten.reciprocal", "aten._foreach_div")):
        return None
    if ev.phase == "optimizer" or _singular_node(ev):
        return None  # optimizer_state_nonfinite / singular_gradient explain it better
    at, phrase = _singular_input(ev)
    if at == "no" or (at == "missing" and ev.phase == "backward"):
        return None
    conf = {"zero": 0.85, "tiny": 0.8}.get(at, 0.5)
    return Cause(
        cause="division_by_zero",
        confidence=conf,
        evidence=f"{_where(ev)} divided by zero: {phrase}",
        fix="add an eps to the denominator: `x / (std + 1e-5)` or `x / d.clamp_min(1e-12)`",
    )


@rule
def singular_gradient(ev: Evidence) -> Cause | None:
    """Needs: phase backward, the op inside the gradient of sqrt / rsqrt / pow(x, p<1) / a norm
    (its autograd node, forward op or op; or a division in backward), AND its input at the
    singular point: the denominator / base holding 0 or a value within rounding of 0.
    Ruled out: input ranges away from 0 (huge finite inputs overflowing: optimizer_divergence),
    normalization layers (LayerNorm & co. have an eps). Without input ranges it fires at low
    confidence and says the ranges are missing."""
    if ev.phase != "backward":
        return None
    fwd = str((ev.first_nonfinite or {}).get("forward_op") or "")
    node = _singular_node(ev)
    if not (node or ev.op.startswith(_SINGULAR_OPS) or fwd.startswith(_SINGULAR_OPS)
            or ev.op.startswith(("aten.div", "aten.reciprocal"))):
        return None
    if any(layer in _node(ev) for layer in _NORM_LAYERS):
        return None
    at, phrase = _singular_input(ev)
    if at == "no":
        return None
    if at == "missing":
        conf = 0.4 if node else 0.3
        phrase = f"not confirmed: {phrase}, so an input at 0 is not shown"
    else:
        conf = 0.9 if node else 0.8
    return Cause(
        cause="singular_gradient",
        confidence=conf,
        evidence=f"{_where(ev)}{' in ' + _node(ev) if _node(ev) else ''}: the forward was "
        f"finite, its gradient is not — sqrt / norm / pow(x, p<1) at exactly 0 have an "
        f"infinite derivative; {phrase}",
        fix="`torch.sqrt(x + 1e-12)`; for a norm, `torch.sqrt((v * v).sum(-1) + 1e-12)` or "
        "`F.normalize(v, eps=1e-12)`; in a custom backward, `grad / d.clamp_min(1e-12)`",
    )


@rule
def masked_softmax(ev: Evidence) -> Cause | None:
    """Needs: origin op a softmax whose input holds -inf (a masked row).

    Ruled out: finite inputs (a softmax of finite values is finite). Without input ranges it
    fires lower."""
    if not ev.op.startswith(_SOFTMAX_OPS):
        return None
    masked = any(_num(i.get("min"), 0.0) == -math.inf for i in ev.inputs)
    if ev.inputs and not masked:
        return None
    return Cause(
        cause="masked_softmax",
        confidence=0.9 if masked else 0.6,
        evidence=f"{_where(ev)}: a row whose every entry is masked to -inf gives 0/0 = NaN"
        + ("" if masked else " (presumed: the input ranges were not recorded)"),
        fix="keep at least one unmasked position per row (e.g. let padding attend to itself), "
        "or fill with `torch.finfo(dtype).min` instead of -inf and zero the output rows",
    )


@rule
def exp_overflow(ev: Evidence) -> Cause | None:
    """Needs: origin op exp with an input above log(dtype max) (~88.7 in float32, ~11.1 in
    float16). Ruled out: inputs all below it. Without input ranges it fires lower."""
    if not ev.op.startswith(("aten.exp", "aten.expm1")):
        return None
    limit = math.log(_finfo((ev.inputs[0].get("dtype") if ev.inputs else None) or ev.dtype).max)
    top = max((_num(i.get("max"), -math.inf) for i in ev.inputs), default=None)
    if top is not None and top < limit:
        return None
    seen = f"its largest input {top:.4g} > {limit:.3g}" if top is not None else (
        "presumed: the input ranges were not recorded")
    nxt = str(((ev.first_nonfinite or {}).get("propagated_by") or {}).get("op") or "")
    if nxt.startswith(_SOFTPLUS_NEXT):
        # `log(1 + exp(z))` / `1 + exp(z)`: a softplus or a sigmoid written by hand; no max
        # to subtract (a softmax fix would not apply).
        what = f"; its result went on into {nxt} (`log(1 + exp(z))` or `1 + exp(z)` by hand)"
        fix = ("use the stable built-ins: `torch.log(1 + torch.exp(z))` -> "
               "`F.softplus(z)`; `1 / (1 + torch.exp(-z))` -> `torch.sigmoid(z)`; a logistic "
               "loss `log(1 + exp(-y * z))` -> `F.softplus(-y * z)` (or "
               "`F.binary_cross_entropy_with_logits`)")
    else:
        what = ""
        fix = ("subtract the max first: `torch.softmax(x, dim)` / `torch.logsumexp`, or "
               "`(x - x.amax(dim, keepdim=True)).exp()`")
    return Cause(
        cause="exp_overflow",
        confidence=0.9 if top is not None else 0.6,
        evidence=f"{_where(ev)}: exp overflows above {limit:.3g} ({seen}){what}",
        fix=fix,
    )


_SOFTPLUS_NEXT = ("aten.add", "aten.rsub", "aten.log1p", "aten.log", "aten.reciprocal")
"""Ops an exp's result flows into in a hand-written softplus / sigmoid (1 + e, log1p(e))."""


@rule
def low_precision_overflow(ev: Evidence) -> Cause | None:
    """Needs: a reduced-precision dtype and an overflow from finite inputs in forward/loss,
    with input magnitudes float32 would hold. Ruled out: inputs so large they would overflow
    float32 too (exploding_init / optimizer_divergence); a dtype with float32's range
    (bfloat16 rounds coarsely but overflows only where float32 would). Without ranges it
    fires lower."""
    if ev.dtype not in _LOW_PRECISION or ev.phase not in ("forward", "loss"):
        return None
    largest = _finfo(ev.dtype).max
    if largest > 1e38:  # bfloat16: float32's 8-bit exponent (3.39e38 against 3.40e38)
        return None
    top = ev.magnitude
    if top is not None and top >= _overflow_scale("float32"):
        return None
    return Cause(
        cause="low_precision_overflow",
        confidence=0.8 if top is not None else 0.6,
        evidence=f"{_where(ev)} overflowed {ev.dtype} (its largest value: {largest:.6g})"
        + (f"; its inputs reach {top:.3g}, fine in float32" if top is not None
           else "; the input ranges were not recorded"),
        fix="use bfloat16 instead of float16, keep this op in float32 "
        "(`with torch.autocast(..., enabled=False): ...x.float()`), or use a GradScaler",
    )


# ---------------------------------------------------------------------- training dynamics


@rule
def optimizer_state_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase optimizer, the update itself making the value from finite gradients.
    Ruled out: cascade alarms or a one-step jump of the loss / grad norm before it
    (optimizer_divergence), a state value already non-finite at step 0 (checkpoint)."""
    if ev.phase != "optimizer":
        return None
    if ev.warnings_before(_CASCADE) or _jump(ev):
        return None  # a cascade that overflowed in the update: optimizer_divergence
    if ev.step == 0 and (ev.first_nonfinite or {}).get("kind") == "state":
        return None  # loaded that way: checkpoint_nonfinite
    param = (ev.first_nonfinite or {}).get("param") or (ev.first_nonfinite or {}).get("module")
    name = ev.optimizer or "the optimizer"
    rounded = _eps_rounds_to_zero(ev)
    if ev.eps == 0:
        eps_note, conf = " with eps=0", 0.85
        fix = f"`{name}(params, eps=1e-8)` (never 0)"
    elif rounded is not None:
        # The eps the run set is fine in float32; in the parameters' dtype it is 0.
        fi = _finfo(rounded)
        eps_note, conf = (f" with eps={ev.eps:g}, which is 0 in {rounded} parameters (the "
                          f"smallest {rounded} value is {fi.smallest_normal * fi.eps:.3g})"), 0.85
        fix = (f"keep float32 master weights (train float32 parameters under autocast + "
               f"GradScaler instead of {rounded} ones), or raise eps to one {rounded} holds: "
               f"eps={ev.eps:g} -> eps=1e-4")
    else:
        eps_note, conf = (f" (eps={ev.eps:g})" if ev.eps is not None else ""), 0.6
        lr = f"lr={ev.lr:g}, " if ev.lr is not None else ""
        fix = (f"look at the update's settings for `{param}` ({lr}eps, weight decay) and at "
               "its gradient scale")
    return Cause(
        cause="optimizer_state_nonfinite",
        confidence=conf,
        evidence=f"gradients were finite but {name}{eps_note} "
        f"produced a non-finite update / state for `{param}` at step {ev.step}",
        fix=f"{fix}; check `nanguard audit` on the optimizer state of your checkpoint",
    )


def _eps_rounds_to_zero(ev: Evidence) -> str | None:
    """The parameters' low-precision dtype when the run's eps (> 0) rounds to 0 in it."""
    if not ev.eps or ev.dtype not in _LOW_PRECISION:
        return None
    name = str(ev.dtype).replace("torch.", "")
    return name if float(torch.tensor(ev.eps, dtype=getattr(torch, name))) == 0.0 else None


def _lr_factor(growth: float) -> float:
    """How many times smaller an LR must be to stop a per-step growth of `growth`: a power of
    ten at least as large as the growth (an LR k times past the stable limit grows the error
    ~2k per step), never less than 10."""
    return max(10.0, 10.0 ** math.ceil(math.log10(max(growth, 1.0)) - 1e-9))


def _lr_cut(ev: Evidence, jump: dict[str, Any] | None,
            spike_ratio: float | None) -> tuple[float, str]:
    """How many times to lower the LR, and why (see optimizer_divergence)."""
    settled = jump is not None and sum(
        1 for h in ev.history if h.get("step", 0) < jump["from"]) >= 5
    if jump is not None and not settled:
        # Divergent from the first updates (an LR typed too large): the first jump measures
        # how far past the stable limit the LR is.
        g = float(jump["growth"])
        return _lr_factor(g), (f"as the first update grew the error {g:.3g}x: an LR about "
                               "that far past the stable limit")
    ratio = spike_ratio if spike_ratio is not None else (
        float(jump["growth"]) if jump is not None else None)
    if ratio is None:
        return 10.0, "no growth measured; 10x is the least that counts"
    # A spike fed back by the optimizer after a healthy stretch: the cut grows with the
    # spike's size (square root: the feedback compounds it over steps), never under 10x.
    factor = max(10.0, float(f"{math.sqrt(ratio):.2g}"))
    return factor, f"from the {ratio:.3g}x spike the optimizer fed back (at least 10x)"


def _lr_at(ev: Evidence, step: int | None) -> float | None:
    """The LR the history records for `step` (finite, > 0), else None."""
    if step is None:
        return None
    for h in ev.history:
        if h.get("step") == step:
            lr = _num(h.get("lr"), math.nan)
            return lr if math.isfinite(lr) and lr > 0 else None
    return None


def _lr_target(ev: Evidence, factor: float, onset: int | None) -> tuple[float, str]:
    """The LR to propose: `factor` below the smaller of the LR at the onset of the growth and
    the LR at the failure. The two differ when a schedule moved the LR in between: under a
    warm-up the failing LR is the schedule's own scaled-down value, and both diverged, so a cut
    of the larger one would still diverge. Returns (new LR, a note on the schedule, empty when
    it did not move)."""
    assert ev.lr is not None
    at = _lr_at(ev, onset)
    if at is None or onset is None or math.isclose(at, ev.lr, rel_tol=1e-6):
        return ev.lr / factor, ""
    target = min(at, ev.lr) / factor
    # The schedule's later steps (a warm-up still rising) are not in the history: the bound
    # is stated for every step, the peak included, so the user sets the peak to it.
    note = (f"; your schedule moved the LR from {at:.3g} at step {onset}, where the growth "
            f"began, to {ev.lr:.3g}: keep every step's LR at or below {target:.3g} (set your "
            "schedule's peak LR to it)")
    return target, note


def _ordinary_before(ev: Evidence) -> str | None:
    """The step before the failure had ordinary magnitudes (grad norm / activation abs-max
    measured, finite and below `HUGE`): what it measured, else None."""
    step = ev.step
    if step is None:
        return None
    before = [h for h in ev.history if h.get("step") == step - 1]
    for h in before:
        seen = [(label, _num(h.get(key), math.nan)) for key, label in
                (("grad_norm", "grad norm"), ("act_max", "activation abs-max"))]
        seen = [(label, v) for label, v in seen if math.isfinite(v)]
        if seen and all(v < HUGE for _, v in seen):
            return ", ".join(f"{label} {v:.3g}" for label, v in seen) + f" at step {step - 1}"
    return None


def _clip_fix(ev: Evidence, healthy: float | None) -> str:
    """The clipping advice, with the run's healthy grad norm and the script's own clip."""
    if not healthy:
        if ev.clip == 0:
            return "your script's clip is 0, i.e. clipping is off: clip the grad norm"
        return "clip the grad norm at ~3x its healthy level"
    to = f"{3 * healthy:.3g}"
    call = f"`torch.nn.utils.clip_grad_norm_(model.parameters(), {to})`"
    if ev.clip == 0:
        return (f"your script's clip is 0, i.e. clipping is off: clip at {to} "
                f"(3x the healthy grad norm {healthy:.3g}): {call}")
    if ev.clip is not None and ev.clip > 3 * healthy:
        return (f"your clip max_norm {ev.clip:g} is far above this run's healthy grad norm "
                f"{healthy:.3g}: lower it to {to}")
    if ev.clip is not None:
        return (f"your clip max_norm {ev.clip:g} already bounds each step's gradient; it "
                "cannot make a too large LR stable")
    return f"clip: {call} (3x the healthy grad norm {healthy:.3g})"


ORDINARY_DECAY = 1.0
"""A weight decay above this is not one anyone tunes to (0 to ~0.5 in practice)."""


def _decay_blamed(ev: Evidence) -> tuple[float, float] | None:
    """(weight_decay, per-step growth |1 - lr * wd|) when the decay, not the LR, makes the
    weights grow: a multiplicative decay (`Evidence.decoupled_decay`) with lr * wd > 2, a
    weight decay out of the ordinary, and an LR that an ordinary decay (0.1) would keep
    stable (lr * 0.1 <= 1: the GPT LR typo lr=1e3 with wd=0.1 is the LR's fault)."""
    wd, lr = ev.weight_decay, ev.lr
    if not ev.decoupled_decay or not wd or not lr or lr * wd <= 2:
        return None
    if wd <= ORDINARY_DECAY or lr * 0.1 > 1:
        return None
    return wd, abs(1 - lr * wd)


@rule
def optimizer_divergence(ev: Evidence) -> Cause | None:
    """Needs, after at least one update (step >= 1): spike / cascade / forecast / overflow
    alarms shortly before the failure, or the loss / grad norm jumping >= 100x in one step,
    or (weaker) the origin op overflowing huge finite inputs (about sqrt of the dtype's
    largest value). Ruled out: a value present in the batch or the loaded state; step 0 (no
    update has run: exploding_init).

    A multiplicative weight decay past the ordinary (AdamW, SGD: lr * weight_decay > 2 with
    weight_decay > 1 while the LR is one a usual decay keeps stable) is what grew the weights:
    the fix lowers the decay, never the LR the run has right.

    The LR it proposes comes from what it measured, never less than 10x below the failing
    one: a run divergent from its first updates (an LR typed too large) is cut by the first
    jump's growth rounded up to a power of ten; a spike fed back after a healthy stretch by
    the square root of the spike's ratio to the healthy grad norm (the demo's cascade at
    lr=0.05 fails in 5 of 10 seeds, in 2 at lr/2, in none at lr/5 or lower). The clip value is
    3x the healthy grad norm before the onset.
    """
    if ev.phase in ("data", "checkpoint") or ev.step == 0:
        return None
    warn = ev.warnings_before(_CASCADE)
    jump = _jump(ev)
    top = ev.magnitude
    huge = ev.step is not None and top is not None and top >= _overflow_scale(
        (ev.inputs[0].get("dtype") if ev.inputs else None) or ev.dtype)
    if huge and _singular_input(ev)[0] in ("zero", "tiny") and _singular_node(ev):
        huge = False  # a singular point explains it (singular_gradient)
    big = _big_update(ev)
    if not (warn or jump or huge or big):
        return None
    ordinary = _ordinary_before(ev) if huge and not (warn or jump) else None
    why: list[str] = []
    spike_ratio: float | None = None
    onsets = ([warn[0]["step"]] if warn else []) + ([jump["from"] + 1] if jump else [])
    healthy = _healthy_grad_norm(ev, before=min(onsets) if onsets else None)
    if warn:
        kinds = ", ".join(sorted({a["kind"] for a in warn}))
        why.append(f"{kinds} alarms from step {warn[0]['step']}")
        spikes = [a for a in warn if a["kind"] == "spike" and math.isfinite(float(a["value"]))]
        if spikes and healthy:
            spike_ratio = float(spikes[0]["value"]) / healthy
            why.append(f"the first spike was {spike_ratio:.3g}x the healthy grad norm "
                       f"{healthy:.3g}")
    if jump:
        name = "grad norm" if jump["signal"] == "grad_norm" else "loss"
        went = [f"the {name} went {jump['before']:.3g} -> {jump['after']:.3g} "
                f"({jump['ratio']:.3g}x)"]
        went += [f"the {'grad norm' if o['signal'] == 'grad_norm' else 'loss'} "
                 f"{o['before']:.3g} -> {o['after']:.3g}" for o in jump["others"]]
        why.append(" and ".join(went) + f" in one update, step {jump['from']} -> {jump['step']}")
    if huge:
        why.append(f"{_where(ev)} overflowed finite inputs as large as {top:.3g} (no input at "
                   "a singular point)")
    if ordinary:
        why.append(f"one update earlier the run was ordinary ({ordinary})")
    if big:
        why.append(f"the update of step {big['step']} moved the weights by {big['ratio']:.3g}x "
                   "their norm (ordinary training: ~1e-4 to ~1e-2 a step)")
    factor, basis = _lr_cut(ev, jump, spike_ratio)
    if big and not (warn or jump):
        # The ratio is measured against the weights after the update: it saturates near 1,
        # so the cut it implies (to ~1% of the weights a step) is a lower bound.
        factor = max(10.0, 10.0 ** round(math.log10(big["ratio"] / 0.01)))
        basis = (f"to bring the {big['ratio']:.3g}x update of step {big['step']} to ~1% of "
                 "the weights a step")
    strong = bool(warn or jump or ordinary or big)
    # Warned but never non-finite: 0.6. An update that replaced the weights explains the
    # out-of-range input of whatever op overflowed next: ranked above that op's own cause.
    conf = 0.6 if ev.step is None else 0.92 if big else 0.85 if strong else 0.65
    probe = (ev.preflight or {}).get("lr_probe") or {}
    div, sug = _num(probe.get("diverge_lr"), math.nan), _num(probe.get("suggested_lr"), math.nan)
    if math.isfinite(div) and ev.lr is not None:
        above = ev.lr >= div
        why.append(f"the preflight's LR probe diverged at lr {div:.2g} on the first batch"
                   + (f", below your lr={ev.lr:g}" if above else f" (your lr={ev.lr:g} is "
                      "below it: the divergence came later in training)"))
        if above and not _preflight_init(ev)[0]:  # (a huge init lowers the probe's LR too)
            conf = min(0.9, conf + 0.05)
        # The probe measured this model's limit: its LR wins over the growth's estimate
        # when the LR is past that limit, else when it is the larger cut.
        if math.isfinite(sug) and 0 < sug < ev.lr and (above or sug < ev.lr / factor):
            factor = ev.lr / sug
            basis = f"a tenth of the preflight's divergence point {div:.2g}"
    mom = f" with momentum {ev.momentum:g}" if ev.momentum else ""
    lr = f"lr={ev.lr:g}" if ev.lr is not None else "its LR"
    decay = _decay_blamed(ev)
    if decay is not None and ev.lr is not None:
        # The LR is ordinary: the weight decay is what multiplies the weights past 1 a step.
        wd, mult = decay
        why.append(f"weight_decay={wd:g} at {lr} multiplies every weight by 1 - lr * "
                   f"weight_decay = {1 - ev.lr * wd:.3g} each step (|{1 - ev.lr * wd:.3g}| > 1: "
                   f"{mult:.3g}x growth a step from the decay alone)")
        target = min(0.1, 0.01 / ev.lr)
        return _weigh_verdict(ev, Cause(
            cause="optimizer_divergence",
            confidence=max(conf, 0.85),
            evidence=f"{ev.optimizer or 'the optimizer'}{mom} at {lr} amplified the weights "
            "step after step: " + "; ".join(why),
            fix=f"lower the weight decay (weight_decay={wd:g} -> weight_decay={target:.3g}: "
            f"lr * weight_decay = {ev.lr * target:.3g}, far below 1; your {lr} is ordinary "
            f"and stays); {_rollback(ev)}",
        ))
    sched = ""
    if ev.lr is not None:
        onset = jump["from"] if jump is not None else (warn[0]["step"] if warn else None)
        target, sched = _lr_target(ev, factor, onset)
        factor = ev.lr / target
        new_lr = f"lr={target:.3g}"
    else:
        new_lr = f"your LR / {factor:.3g}"
    lower = f"lower the LR ({lr} -> {new_lr}: {factor:.3g}x smaller, {basis}{sched})"
    healed = _healed_lr(ev)
    if healed is not None and ev.lr is not None and healed[1] < ev.lr:
        n, at = healed
        lower = (f"lower the LR: heal cut it {n} time{'s' if n > 1 else ''} in this run, {lr} "
                 f"-> lr={at:.3g} ({at / ev.lr:.3g}x); start at or below lr={at:.3g}")
    clip = _clip_fix(ev, healthy)
    # A script that turned its own clipping off: turning it back on is the first fix.
    fixes = [clip, lower] if ev.clip == 0 else [lower, clip]
    return _weigh_verdict(ev, Cause(
        cause="optimizer_divergence",
        confidence=conf,
        evidence=f"{ev.optimizer or 'the optimizer'}{mom} at {lr} "
        + ("replaced the weights in one update: " if big and not (warn or jump)
           else "amplified the error step after step: ") + "; ".join(why)
        + ("" if strong else " (no alarm or loss history shows the growth)"),
        fix=f"{fixes[0]}; {fixes[1]}; add a warm-up; {_rollback(ev)}",
    ))


@rule
def exploding_init(ev: Evidence) -> Cause | None:
    """Needs: a failure in steps 0-2 (forward or loss; backward at step 0) with evidence of
    huge magnitudes there: an activation abs-max or grad norm >= 1e6 in those steps, an
    overflow / forecast alarm, or the origin op's inputs >= 1e6. Ruled out: magnitudes
    measured and ordinary (a log(0) at step 1 is not an init problem), spike / cascade alarms
    or a one-step jump after an update (optimizer_divergence). Nothing measured: it fires at
    low confidence and says what is missing. A value no op made (`kind` state / input, the
    guard's checkpoint finding) or an op fed a NaN is never an init overflow.

    With a preflight (`Evidence.preflight`) that measured layers initialised too large, a
    failure up to step `EARLY` is the init's whatever the updates did (a huge init makes huge
    gradients, the first updates then jump: optimizer_divergence sees the symptom); the
    confidence is highest when the failing layer is one of those measured. A preflight that
    measured every layer within range lowers the confidence of the rule's other evidence."""
    first = ev.first_nonfinite or {}
    flagged, hit = _preflight_init(ev)
    if (flagged and ev.step is not None and ev.step <= EARLY
            and ev.phase not in ("data", "checkpoint") and first.get("kind") not in
            ("state", "input") and not first.get("tensors")):
        return _weigh_verdict(ev, _init_measured(ev, flagged, hit))
    cause = _exploding_init(ev)
    layers = (ev.preflight or {}).get("layers") or []
    if cause is not None and layers and not flagged:
        top = max(layers, key=lambda layer: _num(layer.get("ratio"), 0.0))
        cause.confidence = round(cause.confidence * 0.5, 3)
        cause.evidence += (f"; but the preflight measured every layer's init within range "
                           f"(largest: `{top.get('name')}` at "
                           f"{_num(top.get('ratio'), math.nan):.3g}x 1/sqrt(fan_in))")
    return None if cause is None else _weigh_verdict(ev, cause)


def _init_measured(ev: Evidence, flagged: list[dict[str, Any]],
                   hit: dict[str, Any] | None) -> Cause:
    """exploding_init from the preflight's measurement of the init."""
    lead = hit or flagged[0]
    others = [f.get("location") for f in flagged if f is not lead]
    also = (f" and {len(others)} more layer(s) ({', '.join(map(str, others[:4]))}"
            + (", ..." if len(others) > 4 else "") + ")") if others else ""
    loss = _untrained_loss(ev)
    at = "the failing layer " if hit is not None else ""
    evidence = (f"before training, the preflight measured {at}{_layer_text(lead)}{also} "
                "(PyTorch's default gives 0.58x, Kaiming 1.4x)"
                + (f"; the untrained model's loss on the first batch was {loss:.3g}"
                   if loss is not None else "")
                + f"; {_where(ev)} went non-finite at step {ev.step}")
    call = (lead.get("details") or {}).get("init_call") or "nn.init.kaiming_normal_(w, " \
        "nonlinearity='relu')"
    fix = f"{call}{' for every layer listed' if others else ''}, or drop the custom init " \
        "(PyTorch's default gives 0.58x)"
    return Cause(cause="exploding_init", confidence=0.92 if hit is not None else 0.9,
                 evidence=evidence, fix=fix)


def _exploding_init(ev: Evidence) -> Cause | None:
    """exploding_init from the run's own magnitudes (see `exploding_init`)."""
    if ev.step is None or ev.step > 2:
        return None
    if ev.phase not in ("forward", "loss") and not (ev.phase == "backward" and ev.step == 0):
        return None
    first = ev.first_nonfinite or {}
    if first.get("kind") in ("state", "input") or first.get("tensors"):
        return None  # no op made it: it was loaded or fed in (checkpoint / data)
    if any(i.get("nonfinite") and math.isnan(_num(i.get("min"), 0.0)) for i in ev.inputs):
        return None  # the op received a NaN: it carried a value on, it overflowed nothing
    if ev.warnings_before(("spike", "cascade")) or _jump(ev) or _ordinary_before(ev):
        return None  # the update made it (optimizer_divergence), not the init
    seen, what = _early_magnitude(ev)
    if seen is False:
        return None
    if seen is None:
        if ev.phase == "backward":
            return None
        return Cause(
            cause="exploding_init",
            confidence=0.3,
            evidence=f"{_where(ev)} went non-finite within the first steps, but no magnitude "
            "was measured (no activation abs-max, finite grad norm or op input range): an "
            "init too large is only a guess from the timing; rerun with `activations=True` "
            "or a replay to confirm",
            fix="check the init with `nanguard.preflight(model, batch, ...)`; if activations "
            "grow layer after layer, use `nn.init.kaiming_normal_(w, nonlinearity='relu')`",
        )
    return Cause(
        cause="exploding_init",
        confidence=0.8,
        evidence=f"huge magnitudes before training could move the weights ({what}); "
        f"the value overflowed at {_where(ev)}",
        fix="use the default init or `nn.init.kaiming_normal_(w, nonlinearity='relu')` "
        "(std = gain / sqrt(fan_in)); check with `nanguard.preflight(model, batch, ...)`",
    )


@rule
def bad_batch(ev: Evidence) -> Cause | None:
    """Needs: a spike alarm on a run that never went non-finite. Ruled out: any non-finite
    value (the rules above explain it)."""
    if ev.first_nonfinite is not None:
        return None
    spikes = [a for a in ev.alarms if a["kind"] == "spike"]
    if not spikes:
        return None
    steps = sorted({a["step"] for a in spikes})
    return _weigh_verdict(ev, Cause(
        cause="bad_batch",
        confidence=0.5,
        evidence=f"gradient spikes at steps {steps[:6]} without a NaN: finite but extreme samples",
        fix="look up those steps' batch fingerprints in run.db (table `batches`) and scan the "
        "data (`nanguard scan`); clip the grad norm",
    ))


@rule
def vanishing_gradients(ev: Evidence) -> Cause | None:
    """Needs: a vanishing alarm. Ruled out: none raised."""
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
def replica_divergence(ev: Evidence) -> Cause | None:
    """Needs: a replica_divergence alarm (nanguard.watch.replicas: data-parallel ranks whose
    parameters stopped agreeing bit for bit). Ruled out: none raised (or no process group)."""
    alarms = [a for a in ev.alarms if a["kind"] == "replica_divergence"]
    if not alarms:
        return None
    computed = [a for a in alarms if a.get("signal") == "rerun"]
    if computed:  # a cross-rank re-run: the parameters agree, one rank computes wrong
        a = computed[0]
        return Cause(
            cause="replica_divergence",
            confidence=0.9,
            evidence=f"step {a['step']}: {a['message']}",
            fix=f"take rank {int(a['value'])}'s device out of the job: it repeats a wrong result "
            "that its replicas do not compute (check its ECC counters, run a memory test or the "
            "vendor's diagnostics); resume every rank from the last checkpoint before the step "
            "whose manifest verifies (`nanguard audit CKPT`). The numbers measured after the "
            "step are the fault's, not the model's",
        )
    return Cause(
        cause="replica_divergence",
        confidence=0.8,
        evidence=f"step {alarms[0]['step']}: {alarms[0]['message']}",
        fix="the named rank's parameters changed without the others': suspect its device "
        "(memory errors: check the GPU's ECC counters, run a memory test) or code that updates "
        "parameters on one rank only; resume every rank from a checkpoint whose manifest "
        "verifies (`nanguard audit CKPT`)",
    )


def _rerun_text(r: dict[str, Any]) -> str:
    """What a re-run found, in words: the step, what differed, the setup it ran on."""
    what = "its replay" if r.get("source") == "nonfinite" else "its re-run"
    cross: dict[str, Any] = r["cross_rank"] if isinstance(r.get("cross_rank"), dict) else {}
    if r.get("verdict") == "persistent":
        return (f"rank {r.get('rank')} repeated step {r['step']} bit for bit while rank "
                f"{cross.get('peer', '?')} computed the same batch from the same parameters and "
                f"RNG states differently (persistent on rank {r.get('rank')}: a faulty device)")
    if r.get("verdict") == "reproducible" and cross:
        return (f"step {r['step']} re-ran bit for bit on rank {cross['rank']}, and on rank "
                f"{cross['peer']} from the same batch, parameters and RNG states")
    if r.get("verdict") == "reproducible":
        return (f"{what} of step {r['step']} from the same parameters, RNG states and batch "
                "reproduced it bit for bit")
    differed = []
    if r.get("loss_same") is False:
        differed.append("the loss")
    if r.get("differing"):
        differed.append(f"{r['differing']} gradient(s)")
    det = r.get("deterministic_algorithms")
    setup = [f"device {r['device']}"] if r.get("device") else []
    if det is not None:
        setup.append(f"deterministic algorithms {'on' if det else 'off'}")
    if differed:
        result = f"differed in {' and '.join(differed)}"
    elif r.get("source") == "nonfinite":
        result = "ran clean: no non-finite value"
    else:
        result = "gave another result"
    return (f"{what} of step {r['step']} from the same parameters, RNG states and batch "
            f"{result} (transient" + (f"; {', '.join(setup)}" if setup else "") + ")")


def _weigh_verdict(ev: Evidence, cause: Cause) -> Cause:
    """A cause read from the run's numbers, weighed against the cascade's re-run verdict: a
    `reproducible` one is cited (software or data: the cause stands); after a `transient` one
    (`nondeterministic` leads) the cause drops to half its confidence and its fix, measured
    on the fault's magnitudes, gives way to "diagnose a run without the fault"."""
    r = ev.cascade_verdict()
    if r is None:
        return cause
    if r["verdict"] == "reproducible":
        cause.evidence += f"; {_rerun_text(r)}: software or data, not a fault"
        return cause
    cause.confidence = round(cause.confidence * 0.5, 3)
    if r["verdict"] == "persistent":
        cause.evidence += (f"; but {_rerun_text(r)}: the trouble began with that device's "
                           "fault (see `replica_divergence`), and what followed is its echo")
    else:
        cause.evidence += (f"; but {_rerun_text(r)}: the trouble began with a fault the same "
                           "inputs do not repeat, and what followed is its echo")
    # Its fix was measured on the fault's magnitudes (an LR cut from a 1e37x spike): none.
    cause.fix = ("only if it recurs once the fault is handled (see `nondeterministic`): "
                 "diagnose that run; the magnitudes measured here are the fault's and give no "
                 "LR or clip value")
    return cause


@rule
def nondeterministic(ev: Evidence) -> Cause | None:
    """Needs: the step the trouble began with (the first spike or the first non-finite step
    within the lead window, `Evidence.cascade_verdict`) re-ran differently from the same
    parameters, RNG states and batch (`transient`), or a replay that did not reproduce the
    failure bit for bit. Ruled out: a re-run that reproduced it, or none.

    Which suspect comes first follows the verdict's setup: on the CPU or with deterministic
    algorithms on, the kernels are deterministic, so the hardware (a flipped bit) or state
    outside the RNG; on an accelerator with them off, a non-deterministic kernel."""
    r = ev.cascade_verdict()
    if r is not None and r["verdict"] == "transient":
        det, device = r.get("deterministic_algorithms"), r.get("device")
        if det or device == "cpu":
            suspect = ("suspect the hardware first: the kernels were deterministic "
                       f"({'deterministic algorithms on' if det else 'CPU kernels'}); or state "
                       "the forward keeps outside the RNG (a counter, Python's `random`, a data "
                       "race)")
            fix = ("test the device (memory errors: ECC counters, a memory test; move the job "
                   "off it if a re-run there differs again); resume from the last checkpoint "
                   f"before the step (`nanguard audit CKPT` verifies it); {_rollback(ev)}")
        else:
            suspect = ("deterministic algorithms were off: a non-deterministic kernel (atomic "
                       "adds, autotuning) is the first suspect, a device fault the second")
            fix = ("rerun with `torch.use_deterministic_algorithms(True)`: a re-run that still "
                   "differs points at the device (memory errors: ECC counters, a memory test); "
                   f"resume from the last good checkpoint; {_rollback(ev)}")
        return Cause(cause="nondeterministic", confidence=0.9,
                     evidence=f"{_rerun_text(r)}: {suspect}", fix=fix)
    if ev.reproduced is not False or (r is not None and r["verdict"] == "persistent"):
        return None  # (persistent: this rank's replay ran clean, the fault is another rank's)
    return Cause(
        cause="nondeterministic",
        confidence=0.7,
        evidence="replaying the failing step from the same state, RNG and batch did not give "
        "the same result",
        fix="suspect hardware or a race: rerun with `torch.use_deterministic_algorithms(True)`; "
        "if it still differs, test the device (memory errors, a faulty GPU)",
    )


@rule
def checkpoint_corrupt(ev: Evidence) -> Cause | None:
    """Needs: a `checkpoint_mismatch` alarm (a checkpoint loaded under `nanguard run` whose
    tensors differ from the manifest written at its save). Ruled out: none raised (no manifest
    beside the file, or every tensor matched)."""
    alarms = [a for a in ev.alarms if a["kind"] == "checkpoint_mismatch"]
    if not alarms:
        return None
    return Cause(
        cause="checkpoint_corrupt",
        confidence=0.85,
        evidence=f"step {alarms[0]['step']}: {alarms[0]['message']}",
        fix="the checkpoint changed after it was saved (storage, a copy, or memory): resume "
        "from another copy or an earlier checkpoint whose manifest verifies (`nanguard audit "
        "CKPT`; `nanguard.load(path)` refuses one that does not)",
    )
