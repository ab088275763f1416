"""Rules for the optimizer: an update that made the value from finite gradients
(`optimizer_state_nonfinite`), and an optimizer that amplified the error step after step or
replaced the weights in one update (`optimizer_divergence`), with the LR, clip and
weight-decay fixes computed from the run's own numbers.
"""

from __future__ import annotations

import math
from statistics import median
from typing import Any

import torch

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.fixes import (
    Flag,
    context_words,
    find_flag,
    holders,
    lr_range,
    lr_typo,
    number,
    plausible_lr,
)
from nanguard.explain.rules.common import (
    CASCADE,
    LOW_PRECISION,
    finfo_of,
    first_jump,
    json_num,
    ordinary_before,
    overflow_scale,
    preflight_init,
    recovery_clause,
    singular_input,
    singular_node,
    where_of,
)
from nanguard.explain.rules.dynamics import early_magnitude
from nanguard.explain.rules.faults import weigh_verdict


def optimizer_state_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase optimizer, the update itself making the value from finite gradients.
    Ruled out: cascade alarms or a one-step jump of the loss / grad norm before it
    (optimizer_divergence), a state value already non-finite at step 0 (checkpoint)."""
    if ev.phase != "optimizer":
        return None
    if ev.warnings_before(CASCADE) or first_jump(ev):
        return None  # a cascade that overflowed in the update: optimizer_divergence
    if ev.step == 0 and (ev.first_nonfinite or {}).get("kind") == "state":
        return None  # loaded that way: checkpoint_nonfinite
    param = (ev.first_nonfinite or {}).get("param") or (ev.first_nonfinite or {}).get("module")
    name = ev.optimizer or "the optimizer"
    rounded = _eps_rounds_to_zero(ev)
    flag = find_flag(ev.argv, "eps", [ev.eps] if ev.eps is not None else [])
    flag = flag if flag is not None and ev.eps is not None and math.isclose(
        flag.value, ev.eps, rel_tol=1e-6, abs_tol=1e-30) else None
    if ev.eps == 0:
        eps_note, conf = " with eps=0", 0.85
        fix = (f"{flag.now()} -> {flag.set(1e-8)} (never 0)" if flag is not None
               else f"`{name}(params, eps=1e-8)` (never 0)")
    elif rounded is not None:
        # The eps the run set is fine in float32; in the parameters' dtype it is 0.
        fi = finfo_of(rounded)
        eps_note, conf = (f" with eps={ev.eps:g}, which is 0 in {rounded} parameters (the "
                          f"smallest {rounded} value is {fi.smallest_normal * fi.eps:.3g})"), 0.85
        raise_eps = (f"{flag.now()} -> {flag.set(1e-4)}" if flag is not None
                     else f"eps={ev.eps:g} -> eps=1e-4")
        fix = (f"keep float32 master weights (train float32 parameters under autocast + "
               f"GradScaler instead of {rounded} ones), or raise eps to one {rounded} holds: "
               f"{raise_eps}")
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
    if not ev.eps or ev.dtype not in LOW_PRECISION:
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
            lr = json_num(h.get("lr"), math.nan)
            return lr if math.isfinite(lr) and lr > 0 else None
    return None


def _lr_target(ev: Evidence, factor: float, onset: int | None) -> tuple[float, float | None]:
    """The LR the measurement implies: `factor` below the smaller of the LR at the onset of
    the growth and the LR at the failure, and the onset's LR when a schedule moved it in
    between (else None). Under a warm-up the failing LR is the schedule's own scaled-down
    value, and both diverged, so a cut of the larger one would still diverge."""
    assert ev.lr is not None
    at = _lr_at(ev, onset)
    if at is None or onset is None or math.isclose(at, ev.lr, rel_tol=1e-6):
        return ev.lr / factor, None
    return min(at, ev.lr) / factor, at


def _sched_note(ev: Evidence, at: float | None, onset: int | None, target: float,
                flag: Flag | None) -> str:
    """The schedule's part of the LR fix: the bound holds for every step, the peak included
    (the schedule's later steps, a warm-up still rising, are not in the history)."""
    if at is None or ev.lr is None:
        return ""
    peak = f"set {flag.name}, your schedule's peak, to it" if flag else (
        "set your schedule's peak LR to it")
    return (f"; your schedule moved the LR from {at:.3g} at step {onset}, where the growth "
            f"began, to {ev.lr:.3g}: keep every step's LR at or below {number(target)} ({peak})")


def _lower_lr(ev: Evidence, factor: float, basis: str, onset: int | None,
              probed: bool) -> str:
    """The LR fix: the typo the user presumably made (an LR `TYPO` times the optimizer's
    default whose exponent, sign flipped, is an ordinary LR), else the measured LR brought
    into the range the optimizer trains with (`explain.fixes.plausible_lr`), in the script's
    flag when one set it. `probed`: `factor` came from the preflight's probe of this model."""
    assert ev.lr is not None
    at_onset = _lr_at(ev, onset)
    flag = _lr_flag(ev, [v for v in (ev.lr, at_onset) if v is not None])
    same = flag is not None and math.isclose(flag.value, ev.lr, rel_tol=1e-6)
    name = ev.optimizer or "the optimizer"
    typed = _typed_lr(ev, flag)
    meant = lr_typo(ev.optimizer, typed.value) if typed is not None else None
    if typed is not None and meant is not None:
        default = lr_range(ev.optimizer).default  # type: ignore[union-attr]
        fixed, now = typed.with_text(typed.flipped() or number(meant)), typed.now()
        if typed is not flag:  # `lr=1e-3`, as the other fixes write an LR, no backquotes
            fixed, now = fixed.strip("`"), now.strip("`")
        return (f"did you mean {fixed}? {now} is {_times(typed.value / default)} {name}'s "
                f"default {default:.0e}".replace("e-0", "e-") + ": the same digits with the "
                f"exponent's sign flipped are an LR {name} trains with")
    measured, at = _lr_target(ev, factor, onset)
    target, why = plausible_lr(ev.optimizer, ev.lr, measured, on_this_model=probed)
    cut = ev.lr / target
    sched = _sched_note(ev, at, onset, target, flag)
    several = [f for f in holders(ev.argv, "lr", [ev.lr])
               if math.isclose(f.value, ev.lr, rel_tol=1e-6)] if flag is None else []
    if flag is not None and (same or at is not None):  # the LR, or the schedule's peak
        before, after = flag.now(), flag.set(target)
    elif len(several) > 1:
        # Two flags hold this optimizer's LR (SAC's `--q-lr 3 --policy-lr 3`) and nothing
        # in the finding tells which feeds it: name them all, not a bare `lr=`.
        before = " and ".join(f.now() for f in several)
        after = f"{number(target)}, whichever of them sets this {name}'s LR"
    else:
        # No flag, or one the optimizer's LR is not (a batch-size rule scaled it, or it is
        # another part's LR): the optimizer's own LR, not a guess at how the flag maps to it.
        before, after = f"lr={ev.lr:g}", f"lr={number(target)}"
    return (f"lower the LR ({before} -> {after}: {_times(cut)} smaller, {basis}"
            f"{'; ' + why if why else ''}{sched})")


def _lr_flag(ev: Evidence, values: list[float]) -> Flag | None:
    """The script's LR flag of the failing optimizer (`find_flag`): of several holding its
    LR, the one whose name names the part the finding is in (`--q-lr` for
    `q_optimizer.step()`)."""
    return find_flag(ev.argv, "lr", values, context_words(ev.first_nonfinite))


def _typed_lr(ev: Evidence, flag: Flag | None) -> Flag | None:
    """The LR the user typed: the script's flag for it, else the failing LR when no schedule
    moved it over the recorded steps (as `lr=...`); None when it is not known."""
    if flag is not None:
        return flag
    assert ev.lr is not None
    lrs = [json_num(h.get("lr"), math.nan) for h in ev.history]
    if any(math.isfinite(v) and not math.isclose(v, ev.lr, rel_tol=1e-6) for v in lrs):
        return None
    return Flag(name="lr", text=f"{ev.lr:g}", eq=True)


def _typo(ev: Evidence) -> float | None:
    """The LR the user presumably meant (`explain.fixes.lr_typo`), or None."""
    if ev.lr is None:
        return None
    typed = _typed_lr(ev, _lr_flag(ev, [ev.lr]))
    return lr_typo(ev.optimizer, typed.value) if typed is not None else None


def _times(ratio: float) -> str:
    """A ratio as a user reads it: `25x`, `1e6x` (not `1e+06x`)."""
    return f"{ratio:.3g}x" if ratio < 1e3 else f"{number(float(f'{ratio:.2g}'))}x"


def _healthy_grad_norm(ev: Evidence, before: int | None = None) -> float | None:
    """The median finite grad norm of the recorded steps before step `before` (the jump), else
    the guard's healthy median, else the median of all recorded steps."""
    norms = [json_num(h.get("grad_norm"), math.nan) for h in ev.steps_until_failure()
             if before is None or h.get("step", 0) < before]
    norms = [n for n in norms if math.isfinite(n) and n > 0]
    if before is not None and norms:
        return median(norms)  # the detector's median may include the jump's first steps
    if ev.healthy_grad_norm:
        return ev.healthy_grad_norm
    return median(norms) if norms else None


def _healed_lr(ev: Evidence) -> tuple[int, float] | None:
    """(number of `heal` LR cuts, the LR the last recorded step used) when heal cut the LR
    during the run: the LR the run went on at, measured, not derived from the cut's text."""
    cuts = sum(1 for a in ev.actions if a.get("action") == "lr_cut")
    if not cuts:
        return None
    for h in sorted(ev.history, key=lambda h: h.get("step", 0), reverse=True):
        lr = json_num(h.get("lr"), math.nan)
        if math.isfinite(lr) and lr > 0:
            return cuts, lr
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
    first update), not that the update was large: it does not count. Nor does one after an
    init far too large (the preflight flagged layers, or huge magnitudes in steps 0-2): huge
    weights make huge gradients and the first updates follow (exploding_init's evidence)."""
    if ev.step is None or preflight_init(ev)[0] or early_magnitude(ev)[0]:
        return None
    for h in sorted(ev.history, key=lambda h: h.get("step", 0)):
        s = h.get("step", 0)
        r = json_num(h.get("update_ratio"), math.nan)
        if (0 <= ev.step - s - 1 < BIG_UPDATE_WINDOW and math.isfinite(r) and r >= BIG_UPDATE
                and r != 1.0):
            return {"step": s, "ratio": r}
    return None


def _clip_fix(ev: Evidence, healthy: float | None) -> str:
    """The clipping advice, with the run's healthy grad norm and the script's own clip (in its
    flag when one set it); never the clip the script already has."""
    flag = find_flag(ev.argv, "clip", [ev.clip] if ev.clip is not None else [])
    off = f" ({flag.now()})" if flag is not None else ""
    if not healthy:
        if ev.clip == 0:
            return f"your script's clip is 0{off}, i.e. clipping is off: clip the grad norm"
        return "clip the grad norm at ~3x its healthy level"
    to = float(f"{3 * healthy:.3g}")
    # A hand-written update on raw tensors has no `model` to take `.parameters()` of: the
    # call names the tensors the update changes, where the user would put it.
    hand = ev.optimizer in ("ManualStep", "your hand-written update")
    call = (flag.set(to) if flag is not None
            else f"`torch.nn.utils.clip_grad_norm_(params, {number(to)})` with `params` the "
            "tensors your hand-written update changes (e.g. `[W, b]`), after `backward()` and "
            "before the update" if hand
            else f"`torch.nn.utils.clip_grad_norm_(model.parameters(), {number(to)})`")
    if ev.clip == 0:
        return (f"your script's clip is 0{off}, i.e. clipping is off: clip at {number(to)} "
                f"(3x the healthy grad norm {healthy:.3g}): {call}")
    if ev.clip is not None and ev.clip > to:
        now = flag.now() if flag is not None else f"max_norm {ev.clip:g}"
        return (f"your clip {now} is far above this run's healthy grad norm "
                f"{healthy:.3g}: lower it to {number(to)}" + (f": {call}" if flag else ""))
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


def _decay_change(ev: Evidence, wd: float, target: float) -> str:
    """`weight_decay=5 -> weight_decay=0.01`, in the script's flag when one set it."""
    flag = find_flag(ev.argv, "weight_decay", [wd])
    if flag is not None and math.isclose(flag.value, wd, rel_tol=1e-6):
        return f"{flag.now()} -> {flag.set(target)}"
    return f"weight_decay={wd:g} -> weight_decay={number(target)}"


def _spikes_of_bad_data(ev: Evidence) -> bool:
    """Every warning of a run without a NaN is a spike, and the detectors traced some of them
    to their batches (`detect.bad_batch`): the run is known to carry bad data, and no
    cascade, forecast, overflow or divergence shows the optimizer amplifying anything; a spike
    left unnamed there (a first-epoch bad batch whose loss was no outlier yet) is no case for
    lowering the LR (word_language_model: "lower the LR 10x" after 9 named bad batches)."""
    warn = [a for a in ev.alarms if a["kind"] != "nonfinite"]
    return (bool(warn) and all(a["kind"] == "spike" for a in warn)
            and any(a.get("cause") == "bad_batch" for a in warn))


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
    if ev.first_nonfinite is None and _spikes_of_bad_data(ev):
        return None  # spikes of a run with bad batches, nothing amplified: not the optimizer's
    warn = ev.warnings_before(CASCADE)
    jump = first_jump(ev)
    top = ev.magnitude
    huge = ev.step is not None and top is not None and top >= overflow_scale(
        (ev.inputs[0].get("dtype") if ev.inputs else None) or ev.dtype)
    if huge and singular_input(ev)[0] in ("zero", "tiny") and singular_node(ev):
        huge = False  # a singular point explains it (singular_gradient)
    big = _big_update(ev)
    if not (warn or jump or huge or big):
        return None
    ordinary = ordinary_before(ev) if huge and not (warn or jump) else None
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
    # The first spike's batch named its cause (the live line said so): the run's story keeps
    # it: the data set the spike off, the optimizer is what turned it into a failure.
    first_spike = next((a for a in warn if a["kind"] == "spike"), {})
    by_batch = first_spike.get("cause") == "bad_batch"
    if by_batch:
        why.append(f"it began with a bad batch at step {first_spike['step']} (the data set it "
                   "off; the optimizer fed it back)")
    if jump:
        name = "grad norm" if jump["signal"] == "grad_norm" else "loss"
        went = [f"the {name} went {jump['before']:.3g} -> {jump['after']:.3g} "
                f"({jump['ratio']:.3g}x)"]
        went += [f"the {'grad norm' if o['signal'] == 'grad_norm' else 'loss'} "
                 f"{o['before']:.3g} -> {o['after']:.3g}" for o in jump["others"]]
        why.append(" and ".join(went) + f" in one update, step {jump['from']} -> {jump['step']}")
    if huge:
        why.append(f"{where_of(ev)} overflowed finite inputs as large as {top:.3g} (no input at "
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
    probe, probed = (ev.preflight or {}).get("lr_probe") or {}, False
    div = json_num(probe.get("diverge_lr"), math.nan)
    sug = json_num(probe.get("suggested_lr"), math.nan)
    if math.isfinite(div) and ev.lr is not None:
        above = ev.lr >= div
        why.append(f"the preflight's LR probe diverged at lr {div:.2g} on the first batch"
                   + (f", below your lr={ev.lr:g}" if above else f" (your lr={ev.lr:g} is "
                      "below it: the divergence came later in training)"))
        if above and not preflight_init(ev)[0]:  # (a huge init lowers the probe's LR too)
            conf = min(0.9, conf + 0.05)
        # The probe measured this model's limit: its LR wins over the growth's estimate
        # when the LR is past that limit, else when it is the larger cut.
        if math.isfinite(sug) and 0 < sug < ev.lr and (above or sug < ev.lr / factor):
            factor, probed = ev.lr / sug, True
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
        return weigh_verdict(ev, Cause(
            cause="optimizer_divergence",
            confidence=max(conf, 0.85),
            evidence=f"{ev.optimizer or 'the optimizer'}{mom} at {lr} amplified the weights "
            "step after step: " + "; ".join(why),
            fix=f"lower the weight decay ({_decay_change(ev, wd, target)}: "
            f"lr * weight_decay = {ev.lr * target:.3g}, far below 1; your {lr} is ordinary "
            f"and stays); {recovery_clause(ev)}",
        ))
    if ev.lr is not None:
        onset = jump["from"] if jump is not None else (warn[0]["step"] if warn else None)
        lower = _lower_lr(ev, factor, basis, onset, probed)
    elif (flag := find_flag(ev.argv, "lr")) is not None:
        # A hand-written update reports no LR, but a flag named for one set it.
        lower = (f"lower the LR ({flag.now()} -> {flag.set(flag.value / factor)}: "
                 f"{factor:.3g}x smaller, {basis})")
    else:
        lower = f"lower the LR (your LR / {factor:.3g}: {basis})"
    healed = _healed_lr(ev)
    if (healed is not None and ev.lr is not None and healed[1] < ev.lr
            and _typo(ev) is None):
        n, at = healed
        flag = _lr_flag(ev, [ev.lr])
        start = (flag.set(at) if flag is not None and math.isclose(flag.value, ev.lr)
                 else f"lr={at:.3g}")
        lower = (f"lower the LR: heal cut it {n} time{'s' if n > 1 else ''} in this run, {lr} "
                 f"-> lr={at:.3g} ({at / ev.lr:.3g}x); start at or below {start}")
    clip = _clip_fix(ev, healthy)
    if by_batch:
        clip += ("; find the bad batch (report.json `spikes`: its fingerprint and the rows "
                 "that stand out) and clean that data")
    # A script that turned its own clipping off: turning it back on is the first fix.
    fixes = [clip, lower] if ev.clip == 0 else [lower, clip]
    return weigh_verdict(ev, Cause(
        cause="optimizer_divergence",
        confidence=conf,
        evidence=f"{ev.optimizer or 'the optimizer'}{mom} at {lr} "
        + ("replaced the weights in one update: " if big and not (warn or jump)
           else "amplified the error step after step: ") + "; ".join(why)
        + ("" if strong else " (no alarm or loss history shows the growth)"),
        fix=f"{fixes[0]}; {fixes[1]}; add a warm-up; {recovery_clause(ev)}",
    ))
