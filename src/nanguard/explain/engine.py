"""Run every rule over the evidence and rank what they say."""

from __future__ import annotations

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.rules import RULES


def diagnose(evidence: Evidence) -> list[Cause]:
    """Ranked causes, most confident first; empty for a healthy run.

    A rule that raises is a bug in that rule, not in the user's run: it is skipped so one bad
    rule never hides the others' answers.
    """
    if evidence.first_nonfinite is None and not evidence.alarms:
        # Nothing went non-finite and no detector raised an alarm: a story of what went wrong
        # would contradict the run's `healthy` (a GAN discriminator's loss going 0.003 -> 6 in
        # one step read as "optimizer_divergence: lower the LR" on a healthy DCGAN).
        return []
    causes: list[Cause] = []
    for rule in RULES:
        try:
            cause = rule(evidence)
        except Exception:  # noqa: BLE001 - see docstring
            continue
        if cause is not None:
            causes.append(cause)
    causes.sort(key=lambda c: -c.confidence)
    return causes


__all__ = ["RULES", "diagnose"]
