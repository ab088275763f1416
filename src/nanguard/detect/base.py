"""The detector's contract: a full test (`check`), a quiet update beside it, and its state.

A detector sees one `StepStats` at a time, in step order, and returns the alarms it raises.
`phase = "pre"` detectors only need what is known before `optimizer.step()` (loss, gradients,
activations), so a policy can act on them before the update; `"post"` ones need the step done.

Most steps of a healthy run raise nothing, and a detector's full test walks its windows and
thresholds for that nothing. So each detector also owns its **quiet update**, written beside its
`check` and from the same state, which the quiet gate (`detect.gate`) runs instead of `check`
on a step where nothing is non-finite:

- `quiet(stats, norms)`: when one necessary condition of each of this detector's alarms is
  false on this step (no alarm is possible), make every change `check` would make and return
  the window appends it leaves to the gate (`series.absorb`: one call for all detectors);
  else change nothing and return None, and the gate runs `check`. The base class has none:
  None, always.
- `still`: True while such a step can neither raise an alarm here nor change this detector's
  state (a non-finite detector with no episode open): the gate skips it without a call.

A quiet update is trusted only from the class that also defines `check` (`has_quiet_update`): a
subclass that changes the test without its quiet update takes the full test on every step.
"""

from __future__ import annotations

import math
from typing import Any

from nanguard.config import DetectConfig
from nanguard.detect.alarm import Alarm
from nanguard.watch.stats import StepStats

Append = tuple[Any, float, "dict[str, float] | None", str]
"""A window append a quiet update leaves to the gate: (window, value, levels, key); where
`levels` is a dict, the window's new median is noted there as a typical level of `key`
(`series.absorb`)."""

Norms = tuple[float, float, "float | None"]
"""(`grad_norm`, `param_norm`, `momentum_norm`) of the step: `StepStats.global_norms()`."""


class Detector:
    """Base: a named, stateful, serializable unit (its quiet updates: module docstring)."""

    phase = "post"
    still = False

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.cooldown = config.cooldown
        self._last_fired: dict[tuple[str, str], tuple[int, float]] = {}

    def check(self, stats: StepStats) -> list[Alarm]:  # pragma: no cover - abstract
        raise NotImplementedError

    def quiet(self, stats: StepStats, norms: Norms) -> list[Append] | None:
        """The quiet update (module docstring). Runs only on a sealed step with nothing
        non-finite, where `check` would; `norms` are the step's global norms."""
        return None

    def _fire(
        self,
        stats: StepStats,
        kind: str,
        signal: str,
        value: float,
        msg: str,
        escalates: bool = True,
    ) -> list[Alarm]:
        """Emit one alarm unless the same (kind, signal) fired within the cooldown.

        A new event far more severe than the last one (`value` >= 10x the last fired value, for
        detectors where a larger value is worse) fires even within the cooldown: a spike 1000x
        the median 40 steps after a 20x one is news.
        """
        last = self._last_fired.get((kind, signal))
        escalated = (
            escalates
            and last is not None
            and math.isfinite(value)
            and abs(value) >= 10 * abs(last[1])
        )
        if last is not None and stats.step - last[0] < self.cooldown and not escalated:
            return []
        self._last_fired[(kind, signal)] = (stats.step, value)
        return [Alarm(step=stats.step, kind=kind, signal=signal, value=value, message=msg)]

    def state_dict(self) -> dict[str, Any]:
        return {"last_fired": [[k, s, st, v] for (k, s), (st, v) in self._last_fired.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._last_fired = {(k, s): (int(st), float(v)) for k, s, st, v in state["last_fired"]}


def has_quiet_update(detector: Detector) -> bool:
    """Whether `detector`'s quiet update (and `still`) may stand in for its `check`: both are
    defined by one class, so a subclass that changed the test without its quiet update is not."""
    mro = type(detector).__mro__
    check = next(c for c in mro if "check" in c.__dict__)
    quiet = next(c for c in mro if "quiet" in c.__dict__)
    return check is quiet is not Detector
