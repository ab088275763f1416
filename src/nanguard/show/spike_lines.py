"""One-line summaries of a run's spikes and of `heal` (`spike_line`, `heal_line`): shown in the
terminal summary and the HTML report once a run has ended; nothing here runs while training."""

from __future__ import annotations

import math
from typing import Any

from nanguard.record.report import Report


def report_spike_line(report: Report) -> str | None:
    """The report's spike line (`spike_line`), or None for a run with a non-finite value whose
    only episode is its end: from the first non-finite value on every step is "in spike" by
    the measure's definition (a non-finite value counts as one), which says nothing the
    failure does not (a run non-finite from step 0 would read "100.0% of steps in spike"),
    whatever status it ended with. A run with an earlier episode (it spiked before it broke)
    keeps the line."""
    m = report.spike_measures
    if report.first_nonfinite is not None and m:
        episodes = m.get("episodes") or []
        if int(m.get("episodes_total") or 0) <= 1 and all(e.get("open") for e in episodes):
            return None
    return spike_line(m, loss_stationary=not _loss_trend_off(report, m))


def _loss_trend_off(report: Report, m: dict[str, Any] | None) -> bool:
    """Whether the guard judged the measured part's loss not a stationary series (its
    `loss_trend_off` action: on-policy RL, a GAN): a critic's loss that grows with the returns
    is no spike episode, so its episodes and loss score are not shown as such."""
    part = (m or {}).get("part")
    return any(a.get("action") == "loss_trend_off" and a.get("part") in (None, part)
               for a in report.actions)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2g}%" if 0 < x < 0.01 else f"{100 * x:.1f}%"


def spike_line(m: dict[str, Any] | None, *, loss_stationary: bool = True) -> str | None:
    """One line of spike measures (`report.spike_measures`): `spikes: 3 episodes (1 open),
    1.2% of steps in spike; spike score loss 0.4%, grad norm 0.9%`; None without measures.
    `loss_stationary=False` (the guard turned its loss-trend alarms off): the episodes, which
    are the loss's, and the loss's score are left out and the line says why."""
    if not m or "score" not in m or m.get("steps") == 0:  # nothing measured: nothing to say
        return None
    if not loss_stationary:
        rest = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}" for k, v in m["score"].items()
                         if k != "loss" and v is not None and not _only_nonfinite(m, k))
        return ("spikes: not counted on the loss (not a stationary series here)"
                + (f"; spike score {rest}" if rest else ""))
    n = int(m.get("episodes_total") or 0)
    opened = sum(bool(e.get("open")) for e in m.get("episodes") or [])
    scored = m.get("steps_scored") or {}
    # A score over a handful of steps says little: the count shows how many it rests on.
    score = ", ".join(f"{k.replace('_', ' ')} {_pct(v)}"
                      + (f" of {scored[k]} steps" if isinstance(scored.get(k), int)
                         and scored[k] < 100 else "")
                      for k, v in m["score"].items() if v is not None
                      and not _only_nonfinite(m, k))
    first = (m.get("episodes") or [{}])[0]
    lead = ""
    if first.get("before"):
        sig, b = max(first["before"].items(), key=lambda kv: _rank(kv[1].get("ratio")))
        lead = (f"; before the first: {sig.replace('_', ' ')} {_ratio(b.get('ratio'))} its "
                f"baseline {b.get('steps_before')} step(s) ahead")
    return (f"spikes: {n} episode{'' if n == 1 else 's'}" + (f" ({opened} open)" if opened
                                                               else "")
            + f", {_pct(m.get('time_in_spike'))} of steps in spike"
            + (f"; spike score {score}" if score else "")
            + ("" if m.get("complete", True) else " (not every step: see report.json)")
            + lead)


def heal_line(report: Report) -> str | None:
    """Under `heal`: what it did and what drove the spikes; else, on a run with a loss spike
    episode it came back from (heal's case: spikes that recover or run away, again and again;
    not a run whose one episode is its end in NaN) and an alarm of the guard's own, on an
    objective it judges stationary, the recommendation to try it. None otherwise."""
    heal = (report.run.get("recovery") or {}).get("heal")
    if report.run.get("policy") == "heal":
        if not heal:
            return None
        cuts = heal.get("cuts") or []
        lrs = [c["lr"] for c in cuts if c.get("action") == "lr_cut" and c.get("lr")]
        factor = heal.get("lr_factor") or 1.0
        # Several cuts: the last cut's cause names the LR it cut, already lowered by the
        # earlier ones; say where the cuts began and how far they went in all.
        overall = (f" (LR cuts from lr {lrs[0]:.3g}: x{factor:.3g} of the scheduler's in all)"
                   if len(lrs) > 1 else "")
        # Steps lost: heal's clips lose none; a non-finite step it skipped is one.
        skipped = int((report.run.get("recovery") or {}).get("updates_skipped") or 0)
        lost = int(heal.get("steps_lost") or 0) + skipped
        cost = (f", {lost} step(s) lost" + (f" ({skipped} non-finite update(s) skipped)"
                                            if skipped else ""))
        if heal.get("seconds") and (heal.get("updates_clipped") or cuts):
            cost += f", {float(heal['seconds']) * 1e3:.3g} ms acting"
        return (f"heal: {heal.get('updates_clipped', 0)} spike precursor(s) clipped, "
                f"{len(cuts)} cut(s){cost}"
                + (f"; what drove the spikes: {heal['cause']}" if heal.get("cause") else "")
                + overall)
    m = report.spike_measures or {}
    # Only where the guard itself saw trouble: on a healthy run the measure's episodes are a
    # noisy or non-stationary loss (off-policy RL, a GAN), not spikes heal would fix.
    trend_off = any(a.get("action") == "loss_trend_off" for a in report.actions)
    if (report.alarms and not trend_off
            and any(not e.get("open") for e in m.get("episodes") or [])):
        return ("remedy: policy='heal' clips the grad-norm jump that comes before a loss spike "
                "and cuts the weight decay or the LR when the jumps recur")
    return None


def _only_nonfinite(m: dict[str, Any], key: str) -> bool:
    """Whether every step the score of `key` rests on was a spike: before the window fills
    only non-finite values are scored (each one a spike), so a run non-finite from its first
    steps would read "100.0%", which says nothing the non-finite count does not."""
    scored = (m.get("steps_scored") or {}).get(key)
    return bool(scored) and (m.get("spike_steps") or {}).get(key) == scored


def _rank(x: Any) -> float:
    if isinstance(x, (int, float)):
        return x if math.isfinite(x) else math.inf
    return math.inf if x in ("nan", "inf") else -math.inf


def _ratio(x: Any) -> str:
    return f"{x:.3g}x" if isinstance(x, (int, float)) and math.isfinite(x) else f"{x}x"
