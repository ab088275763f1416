"""The run log: everything a run has seen that its report and diagnosis are made of.

One object owns the alarms, actions, the first non-finite finding, the spikes and the steps
that led into a failure. Each record goes to the run store (run.db) and to the event listeners
(live log, callbacks, exporters) in one place, here, so the three never disagree. The Guard
feeds it; `plain()` is the plain-data log `explain` reads (`Guard.run_log()`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from nanguard.detect.alarm import Alarm
from nanguard.detect.detectors import Detector, SpikeDetector
from nanguard.record.events import Events
from nanguard.record.finding import Finding
from nanguard.record.report import RECOVERING
from nanguard.record.store import NullStore
from nanguard.watch.stats import StepStats

HISTORY = 64
"""Steps kept for the summary and the diagnosis (the last ones up to the failure)."""

class RunLog:
    """Alarms, actions, finding, spikes and step history of one guard's run.

    Args:
        store: the run store records are written to (`NullStore` when recording is off).
        events: the guard's event stream; every record is announced there as it is added.
    """

    def __init__(self, store: NullStore, events: Events) -> None:
        self.store = store
        self.events = events
        self.alarms: list[Alarm] = []
        """Every alarm, in the order recorded."""
        self.actions: list[dict[str, Any]] = []
        """Every action (`step`, `action`, `detail`), as report.json's `actions`."""
        self.finding: Finding | None = None
        """The first non-finite finding, once one was seen."""
        self.failing: StepStats | None = None
        """The step where the first non-finite value showed (its statistics)."""
        self.spikes: list[dict[str, Any]] = []
        """Where each spike sits: step, layers, samples (and a re-run verdict)."""
        self.history: deque[StepStats] = deque(maxlen=HISTORY)
        """The last steps up to (and one past) the first non-finite one."""
        self.recovered_from = False
        """A skip or rollback was recorded: the report says whether the model came back."""
        self.resumed: dict[str, Any] = {}
        """The run log's `history` and `failing` from before a resume (`load_state_dict`)."""

    # -- alarms and actions

    def add_alarms(self, alarms: list[Alarm]) -> None:
        """The detectors' alarms of one step; run.db gets them with the step's row."""
        self.alarms += alarms
        self.events.alarms([a.to_dict() for a in alarms])

    def add_alarm(self, alarm: Alarm, *, said: bool = False) -> None:
        """An alarm raised outside the detectors (recovery's `amp_collapse`, the saturation
        probe, replica agreement): written to run.db at once. `said`: the person was already
        told (its event is not `notable`: no second live line)."""
        self.alarms.append(alarm)
        self.store.write_alarm(alarm.to_dict())
        self.events.alarm(alarm.to_dict(), said=said)

    def add_action(self, step: int, action: str, detail: str) -> None:
        """What was done at `step` (report.json `actions`; written to run.db at once)."""
        self.actions.append({"step": step, "action": action, "detail": detail})
        self.recovered_from |= action in RECOVERING
        self.store.write_action(step, action, detail)
        self.events.action(step, action, detail)

    def add_spike(self, step: int, found: dict[str, Any]) -> None:
        """Where a spike at `step` sits (`pinpoint.live.explain_spike`)."""
        self.spikes.append({"step": step, **found})

    # -- the first non-finite finding

    def set_finding(self, found: Finding | Mapping[str, Any], *,
                    failing: StepStats | None = None, write: bool = True,
                    announce: bool = False) -> None:
        """Take `found` as the first non-finite finding (replacing any); `failing`: the step
        it showed in, kept unless one is already. `write`: to run.db now; `announce`: a
        `finding` event."""
        self.finding = found if isinstance(found, Finding) else Finding.from_dict(found)
        if failing is not None and self.failing is None:
            self.failing = failing
        self._publish(write, announce)

    def refine_finding(self, values: Mapping[str, Any], *, write: bool = True,
                       announce: bool = True) -> None:
        """Merge what a replay found into the finding (there must be one)."""
        assert self.finding is not None
        self.finding.update(values)
        self._publish(write, announce)

    def finding_dict(self) -> dict[str, Any] | None:
        """report.json's `first_nonfinite` (None before one)."""
        return None if self.finding is None else self.finding.to_dict()

    def _publish(self, write: bool, announce: bool) -> None:
        if self.finding is None or not (write or announce):
            return
        body = self.finding.to_dict()
        if write:
            self.store.write_finding(body)
        if announce:  # explained at close (the summary or the closing finding line)
            self.events.finding(body, follows=True)

    # -- plain data

    def plain(self, *, optimizer: torch.optim.Optimizer, params: list[torch.Tensor],
              detectors: list[Detector], lead_window: int,
              facts: Mapping[str, Any]) -> dict[str, Any]:
        """The run log as plain data (see `Guard.run_log`); `facts`: how nanguard was started
        (`script_clip`, `entry`, `preflight`)."""
        healthy = None
        for d in detectors:
            if isinstance(d, SpikeDetector) and d.history["grad_norm"]:
                healthy = 10 ** statistics.median(d.history["grad_norm"])
        failing = self.failing
        return {
            "first_nonfinite": self.finding_dict(),
            "alarms": [a.to_dict() for a in self.alarms],
            "actions": list(self.actions),
            "spikes": list(self.spikes),
            "optimizer": optimizer_facts(optimizer, params),
            "failing": self.resumed.get("failing") if failing is None else {
                "step": failing.step, "lr": failing.lr,
                "bad_tensors": list(failing.nonfinite_tensors),
                "n_batch_tensors": failing.batch_tensors,
            },
            "healthy_grad_norm": healthy,
            "history": self.resumed.get("history", []) + [s.record() for s in self.history],
            "lead_window": lead_window,
            **facts,
        }

    def state_dict(self) -> dict[str, Any]:
        """The log's part of `Guard.state_dict` (without `log`, which needs `plain`)."""
        return {"alarms": [a.to_dict() for a in self.alarms], "actions": list(self.actions),
                "first_nonfinite": self.finding_dict(), "spikes": list(self.spikes)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` (and `Guard.state_dict`'s `log`) returned."""
        self.alarms = [Alarm(**a) for a in state["alarms"]]
        self.actions = list(state["actions"])
        self.recovered_from = any(a["action"] in RECOVERING for a in self.actions)
        found = state["first_nonfinite"]
        self.finding = None if found is None else Finding.from_dict(found)
        self.spikes = list(state.get("spikes", []))
        self.resumed = dict(state.get("log") or {})


def optimizer_facts(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
                    ) -> dict[str, Any]:
    """The optimizer's settings the diagnosis weighs: name, lr, momentum, eps, dtype."""
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    momentum = group.get("momentum")
    if momentum is None and isinstance(group.get("betas"), (tuple, list)):
        momentum = group["betas"][0]
    dtypes = {str(p.dtype) for p in params}
    name = type(optimizer).__name__
    return {
        # `nanguard run`'s stand-in for hand-written updates is no optimizer the user knows.
        "name": "your hand-written update" if name == "ManualStep" else name,
        "lr": group.get("lr") if isinstance(group.get("lr"), (int, float)) else None,
        "momentum": momentum if isinstance(momentum, (int, float)) else None,
        "eps": group.get("eps") if isinstance(group.get("eps"), (int, float)) else None,
        "dtype": dtypes.pop() if len(dtypes) == 1 else None,
    }
