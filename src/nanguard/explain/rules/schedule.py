"""Rules for the LR schedule: an LR that jumped without warm-up (`lr_jump`), a resume's first
step included, named as the cause of the trouble that followed it.
"""

from __future__ import annotations

import re
from typing import Any

from nanguard.explain.evidence import Cause, Evidence
from nanguard.policy.lr_change import FOLLOWS, Jump, parse

_TROUBLE = ("spike", "divergence", "cascade", "forecast", "overflow", "nonfinite", "resume_loss",
            "lr_jump_loss")
"""Alarms that, within `FOLLOWS` steps after a jump, follow from it."""

_LOSS = re.compile(r"the loss rose to (\S+) at step (\d+)")

RAMP = 100
"""The warm-up a fix proposes, in steps (`HealConfig.ramp_steps`' default)."""


def lr_jump(ev: Evidence) -> Cause | None:
    """Needs: an `lr_jump` alarm on the LR (it went up >= 3x in one step: `policy.lr_change`)
    and, within `FOLLOWS` steps from it, trouble: a spike, divergence, cascade, overflow or
    non-finite value, the loss far above its level before the jump (`lr_jump_loss`) or at save
    (`resume_loss`); or `heal`'s ramp over it (then the trouble it answered is the
    jump's, at a lower confidence). Ruled out: a jump with nothing after it (a warm restart the
    run took in its stride stays a warning, not a cause); trouble only before the jump."""
    for a in ev.alarms:
        if a.get("kind") != "lr_jump" or a.get("signal") != "lr":
            continue
        jump = parse(str(a.get("message", "")), int(a["step"]))
        if jump is None:
            continue
        after = [b for b in ev.alarms if jump.step <= int(b["step"]) <= jump.step + FOLLOWS
                 and b["kind"] in _TROUBLE]
        nonfinite = ev.step is not None and jump.step <= ev.step <= jump.step + FOLLOWS
        ramped = any(x.get("action") == "lr_ramp" and x.get("step") == jump.step
                     for x in ev.actions)
        if not (after or nonfinite or ramped):
            continue
        return _cause(ev, jump, after, nonfinite, ramped)
    return None


def _cause(ev: Evidence, jump: Jump, after: list[dict[str, Any]], nonfinite: bool,
           ramped: bool) -> Cause:
    then = []
    if nonfinite:
        then.append(f"a non-finite value at step {ev.step}")
    for b in after[:2]:
        m = _LOSS.match(str(b.get("message", "")))
        if b["kind"] in ("lr_jump_loss", "resume_loss") and m:
            before = "before the jump" if b["kind"] == "lr_jump_loss" else "at save"
            then.append(f"the loss rose to {m[1]} at step {m[2]} "
                        f"({float(b['value']):.3g}x its level {before})")
        else:
            then.append(f"a {b['kind']} alarm on the {b['signal']} at step {b['step']}")
    evidence = jump.text()[0].upper() + jump.text()[1:]
    if then:
        evidence += "; then " + "; ".join(then)
    if ramped:
        evidence += (f"; heal ramped the LR back up from {jump.old:.3g} from step {jump.step}"
                     + ("" if then else " (no spike followed)"))
    where = ("after the resume (a warm-up after the resume point)" if jump.resumed
             else f"from step {jump.step}")
    fix = (f"warm the LR up from {jump.old:.3g} to {jump.new:.3g} over ~{RAMP} steps {where}, "
           f"e.g. a linear ramp in the schedule")
    if not ramped:
        fix += (" (or `nanguard run --policy heal`, which ramps it)" if ev.entry == "run"
                else " (or `Guard(..., policy='heal')`, which ramps it)")
    confidence = 0.8 if (after or nonfinite) else 0.6
    return Cause(cause="lr_jump", confidence=confidence, evidence=evidence, fix=fix)
