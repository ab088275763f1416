"""The quiet gate: each detector's quiet update on a step where nothing is non-finite.

Most steps of a healthy run raise nothing, yet each detector's full test (`check`) walks its
windows and thresholds for that nothing. Every detector owns a quiet update beside its `check`
(`detect.base`): on a step it cannot alarm on, the update makes the changes `check` would and
leaves its window appends; else it changes nothing and `check` runs, for that detector only
(detectors share no state, so each is decided on its own). The gate is the loop over them.

What it guarantees: after every step, each detector's state is exactly what `check` would have
left (the same `state_dict`), and the alarms are the ones `check` would have raised, in the
same order. A step holding anything non-finite (or a float32 overflow, or a non-finite buffer
training does not read) takes every `check`: that is the non-finite detectors' business, and
rare. Differential tests (`tests/detect/test_quiet_gate.py`, `tests/test_quiet_gate_runs.py`)
run both paths over many traces and runs and compare alarms and states.
"""

from __future__ import annotations

from typing import Any

from nanguard.detect.alarm import Alarm
from nanguard.detect.base import Append, Detector, has_quiet_update
from nanguard.detect.series import absorb
from nanguard.watch.stats import StepStats


class QuietGate:
    """Runs the detectors of a phase, each through its quiet update where it has one.

    Args:
        detectors: the guard's detectors, pre-step ones first.

    Attributes:
        enabled: False sends every step through every `check` (`DetectConfig.quiet_gate`).
        passed: steps (phases) on which no detector needed its `check`.
    """

    def __init__(self, detectors: list[Detector]) -> None:
        self.enabled: bool = all(getattr(d.config, "quiet_gate", True) for d in detectors)
        self.passed: int = 0
        # Per phase: (detector, its quiet update or None), bound once (no lookup per step);
        # `both` (a step read after its update) is pre then post, as the guard runs them.
        pairs = {phase: tuple((d, d.quiet if has_quiet_update(d) else None)
                              for d in detectors if d.phase == phase)
                 for phase in ("pre", "post")}
        self._phases: dict[str, tuple[tuple[Any, Any], ...]] = {
            **pairs, "both": pairs["pre"] + pairs["post"]}

    def run(self, stats: StepStats, phase: str, signals: list[str]) -> list[Alarm]:
        """The alarms of the detectors of `phase` (`pre`, `post` or `both`) on `stats`, each
        detector's state updated as its `check` would.

        Runs where the guard runs the detectors, after `stats.seal()` (`signals`: what it
        returned). A quiet update that meets an arithmetic error (an overflow in `10 ** x`) has
        changed nothing: that detector's `check` meets it.
        """
        pairs = self._phases[phase]
        alarms: list[Alarm] = []
        if not self.enabled or signals or stats.overflowed or stats.unread_nonfinite:
            for d, _ in pairs:
                alarms += d.check(stats)
            return alarms
        norms = stats.sealed_norms or stats.global_norms()  # sealed: no call
        if stats.clip_norm is not None:  # the script clipped: judged before its clip
            norms = (stats.clip_norm, norms[1], norms[2])
        appends: list[Append] = []
        passed = True
        for d, quiet in pairs:
            found = None
            if quiet is not None:
                if d.still:
                    continue
                try:
                    found = quiet(stats, norms)
                except (ArithmeticError, LookupError, ValueError):
                    found = None
            if found is None:
                alarms += d.check(stats)
                passed = False
            else:
                appends += found
        if appends:
            absorb(appends)
        self.passed += passed
        return alarms
