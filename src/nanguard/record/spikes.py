"""Spike measures of a run, the way large runs measure them (OLMo 2's spike score), computed
from the per-step series the run store records.

`SpikeMeter.update` takes one step's recorded values and costs O(1) (running sums over a ring
of the last `window` values, no numpy); `summary()` gives report.json's `spike_measures`. The
meter never runs on the training thread: the store's compactor feeds it the steps it is about
to compact (on the writer thread, its state saved in the same transaction) and
`nanguard.record.spike_run` feeds it the steps still in run.db when the report is built. So
every step counts once, at full resolution, on a live run, a run rebuilt from run.db and an
old run alike.

The definition (also written into every report, `definition.text`):

- Spike score of a signal (loss, grad_norm, update_ratio): the share of its scored steps whose
  value lies more than `sigmas` (7) standard deviations from the mean of the previous
  `window` (1000) finite values of that signal. Before `window` values exist the window is all
  previous finite values, once there are at least `min_window` (20); a finite value with fewer
  before it is not scored. The standard deviation is the population one (ddof 0), floored at
  `rel_floor` x |mean| so a constant series followed by float noise is not a spike; the
  denominator counts scored steps only. A non-finite value is always scored, as a spike, and
  never enters a window. Finite spikes do enter later windows (as OLMo's rolling mean does).
  A signal is read where it was recorded: the update ratio is measured every
  `WatchConfig.update_ratio_every` (10) steps, so its window is its last 1000 measurements and
  its score counts the measured steps (the update norm itself is not stored: the ratio is).
- Spike episode (loss only): starts at a loss spike upwards (value > mean + 7 sigma) or a
  non-finite loss, while no episode is open. Its level is that window mean, frozen at the
  jump. It ends at the first later step with a finite loss at or below the level plus
  `recover_within` (10%) of |level| (any finite loss when there was no window yet); that
  step is `recovered_at`, `recovery_steps` = recovered_at - start. An episode the run ends in
  is `open` (recovered_at null). Its peak is its largest loss (non-finite counts as largest).
  `before`: for each precursor signal (`PRECURSORS`: grad_norm, update_ratio, momentum_norm =
  the optimizer's first moment, second_moment_norm = its second moment, act_max, and
  attn_logit_max = the largest |attention logit|), the largest ratio of the value to its own
  rolling mean (same window, `min_window` values needed) over the `lookback` (3) steps before
  the jump, and `min_ratio`, the smallest there (a fall precedes spikes too: Adam's second
  moment decayed far below its mean turns an ordinary gradient into a large update);
  `at_jump`: that ratio at the jump step itself. A signal the run did not measure
  (no Adam, no attention, activations not watched) or did not measure within the lookback (the
  sampled ones) is absent; `measured` counts each precursor's measured steps, so "not
  measured" (0) reads apart from "measured, not elevated" (absent from `before`, count > 0).
- Time in spike: steps from an episode's start up to (not including) its recovery, or to the
  end of the run, over the steps with a recorded loss.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from nanguard.record.spike_window import Window

SCORED = ("loss", "grad_norm", "update_ratio")
"""Signals that get a spike score."""
PRECURSORS = ("grad_norm", "update_ratio", "momentum_norm", "second_moment_norm", "act_max",
              "attn_logit_max")
"""Signals whose ratio to their own baseline is reported before each episode."""
SIGNALS = ("loss", *PRECURSORS)
"""Every signal the meter reads (`steps` columns)."""
MAX_EPISODES = 100
"""Episodes kept in full in the report (the first ones); `episodes_total` counts them all."""


@dataclass(kw_only=True, frozen=True)
class SpikeDefinition:
    """What counts as a spike, an episode and a recovery (see the module docstring)."""

    window: int = 1000
    """Previous finite values the rolling mean and standard deviation are taken over."""
    min_window: int = 20
    """Finite values needed before a step is scored (before that: not scored)."""
    sigmas: float = 7.0
    """A value further than this many standard deviations from the rolling mean is a spike."""
    rel_floor: float = 1e-6
    """The standard deviation is at least this share of |mean| (a constant series has none)."""
    recover_within: float = 0.1
    """An episode ends when the loss is back within this share of |level| above its level."""
    lookback: int = 3
    """Steps before the jump searched for what preceded it."""


DEFAULT = SpikeDefinition()

TEXT = (
    "spike: a value more than {sigmas:g} standard deviations (population, at least "
    "{rel_floor:g} x |mean|) from the mean of the previous {window} finite values (all previous "
    "ones while fewer exist, none scored before {min_window}); non-finite values are spikes and "
    "stay out of windows; score = spikes / scored steps. episode: from a loss spike upwards (or "
    "a non-finite loss) to the first finite loss within {recover_within:.0%} of the pre-spike "
    "mean, or open at the end; time in spike = episode steps / steps with a loss; before: "
    "largest value / own rolling mean in the {lookback} steps before the jump, per precursor "
    "(grad norm, update ratio, first and second optimizer moment norms, activation max, "
    "largest |attention logit|) measured there. grad norm: the total norm before the "
    "script's own clipping where nanguard saw it (clip_grad_norm_'s return), else the norm "
    "at the optimizer step."
)


class SpikeMeter:
    """Spike score, episodes and time in spike over a run's steps, fed one step at a time in
    step order (each step once: a step at or before `last_step` is ignored)."""

    def __init__(self, definition: SpikeDefinition = DEFAULT) -> None:
        self.definition = definition
        self.windows = {k: Window(definition.window) for k in SIGNALS}
        self.scored = dict.fromkeys(SCORED, 0)
        self.spikes = dict.fromkeys(SCORED, 0)
        self.loss_steps = 0
        self.in_spike = 0
        self.measured = dict.fromkeys(PRECURSORS, 0)
        self.last_step = -1
        self.episodes: list[dict[str, Any]] = []
        self.episodes_total = 0
        self.open: dict[str, Any] | None = None
        # (step, {signal: (value, baseline or None)}) of the last steps: what preceded a jump.
        self.recent: deque[tuple[int, dict[str, tuple[float, float | None]]]] = deque(
            maxlen=definition.lookback + 1)

    def update(self, step: int, values: Mapping[str, float | None]) -> None:
        """Take one recorded step (`values`: signal -> value, None where not recorded)."""
        if step <= self.last_step:
            return
        self.last_step = step
        d = self.definition
        record: dict[str, tuple[float, float | None]] = {}
        loss_up = False
        loss_mean = None
        for name in SIGNALS:
            x = values.get(name)
            if x is None:
                continue
            x = float(x)  # a numpy scalar would leak numpy types into the report
            w = self.windows[name]
            finite = math.isfinite(x)
            mean = std = None
            if len(w) >= d.min_window:
                mean, std = w.stats()
            record[name] = (x, mean)
            if name in self.measured:
                self.measured[name] += 1
            if name in self.scored and (mean is not None or not finite):
                self.scored[name] += 1
                spike = not finite
                if finite and mean is not None and std is not None:
                    limit = d.sigmas * max(std, d.rel_floor * abs(mean))
                    spike = abs(x - mean) > limit
                    if name == "loss":
                        loss_up = x - mean > limit
                self.spikes[name] += int(spike)
            if name == "loss":
                # The level an episode must come back to: the window's mean, even a short one
                # (a non-finite loss before `min_window` values still opens an episode).
                loss_mean = w.stats()[0] if len(w) else None
                loss_up = loss_up or not finite
            if finite:
                w.push(x)
        self.recent.append((step, record))
        if "loss" in record:
            self._episode(step, record["loss"][0], loss_up, loss_mean)

    def _episode(self, step: int, x: float, up: bool, mean: float | None) -> None:
        """Open, extend or close the loss spike episode with this step's loss."""
        self.loss_steps += 1
        ep = self.open
        if ep is not None:
            level = ep["baseline"]
            back = math.isfinite(x) and (
                level is None or x <= level + self.definition.recover_within * abs(level))
            if back:
                ep.update(recovered_at=step, recovery_steps=step - ep["start"], open=False)
                self.open = None
                return
            self.in_spike += 1
            if _rank(x) > _rank(ep["peak_value"]):
                ep.update(peak_step=step, peak_value=x)
            return
        if not up:
            return
        self.in_spike += 1
        before, at_jump = self._precursors(step)
        ep = {"start": step, "value": x, "baseline": mean, "peak_step": step, "peak_value": x,
              "recovered_at": None, "recovery_steps": None, "open": True,
              "before": before, "at_jump": at_jump}
        self.open = ep
        self.episodes_total += 1
        if len(self.episodes) < MAX_EPISODES:
            self.episodes.append(ep)

    def _precursors(self, start: int) -> tuple[dict[str, Any], dict[str, float]]:
        """Per precursor signal: the largest value / rolling mean in the `lookback` steps
        before `start`, and that ratio at `start` itself."""
        before: dict[str, Any] = {}
        at_jump: dict[str, float] = {}
        for step, rec in self.recent:
            k = start - step
            for name in PRECURSORS:
                x, base = rec.get(name, (math.nan, None))
                if base is None or base <= 0:
                    continue
                ratio = x / base
                if k == 0:
                    at_jump[name] = ratio
                elif 1 <= k <= self.definition.lookback:
                    b = before.get(name)
                    if b is None or _rank(ratio) > _rank(b["ratio"]):
                        low = ratio if b is None else b["min_ratio"]
                        b = before[name] = {"ratio": ratio, "steps_before": k, "value": x,
                                            "baseline": base, "min_ratio": low}
                    if _low(ratio) < _low(b["min_ratio"]):
                        b["min_ratio"] = ratio
        return before, at_jump

    def now(self) -> dict[str, float]:
        """The measures so far, as scalars a tracker plots per step: `in_spike` (1 while a
        loss episode is open), `spike_episodes` (episodes so far), `time_in_spike` and the
        running spike score of each scored signal (`spike_score_<signal>`, fractions 0..1; a
        score or share with nothing counted yet is left out). O(1)."""
        out = {"in_spike": 1.0 if self.open is not None else 0.0,
               "spike_episodes": float(self.episodes_total)}
        if self.loss_steps:
            out["time_in_spike"] = self.in_spike / self.loss_steps
        for k in SCORED:
            if self.scored[k]:
                out[f"spike_score_{k}"] = self.spikes[k] / self.scored[k]
        return out

    def summary(self) -> dict[str, Any]:
        """report.json's `spike_measures` (ratios and scores as fractions, 0..1)."""
        d = self.definition
        return {
            "score": {k: self.spikes[k] / n if (n := self.scored[k]) else None for k in SCORED},
            "spike_steps": dict(self.spikes),
            "steps_scored": dict(self.scored),
            "episodes": [dict(e) for e in self.episodes],
            "episodes_total": self.episodes_total,
            "time_in_spike": self.in_spike / self.loss_steps if self.loss_steps else None,
            "steps_in_spike": self.in_spike,
            "steps": self.loss_steps,
            "measured": dict(self.measured),
            "complete": True,
            "definition": {**asdict(d), "text": TEXT.format(**asdict(d))},
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to go on later (JSON-able; non-finite floats as JSON allows in
        Python: NaN / Infinity tokens)."""
        return {
            "definition": asdict(self.definition),
            "windows": {k: w.values() for k, w in self.windows.items()},
            "scored": self.scored, "spikes": self.spikes, "loss_steps": self.loss_steps,
            "in_spike": self.in_spike, "last_step": self.last_step, "measured": self.measured,
            "episodes": self.episodes, "episodes_total": self.episodes_total,
            "open_episode": self.open,
            "recent": [[s, {k: list(v) for k, v in rec.items()}] for s, rec in self.recent],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> SpikeMeter:
        """A meter that goes on from `state_dict()`'s output."""
        meter = cls(SpikeDefinition(**state["definition"]))
        for k, values in state["windows"].items():
            if k in meter.windows:
                meter.windows[k].extend(values)
        meter.scored.update(state["scored"])
        meter.spikes.update(state["spikes"])
        meter.loss_steps = int(state["loss_steps"])
        meter.in_spike = int(state["in_spike"])
        # A state saved before `measured` existed: its earlier steps were not counted.
        meter.measured.update(state.get("measured") or {})
        meter.last_step = int(state["last_step"])
        meter.episodes = list(state["episodes"])
        meter.episodes_total = int(state["episodes_total"])
        if state.get("open_episode") is not None:
            ep = state["open_episode"]
            # The open episode is the same object as its entry in `episodes` (when kept).
            same = [e for e in meter.episodes if e["start"] == ep["start"]]
            meter.open = same[0] if same else dict(ep)
        for s, rec in state["recent"]:
            meter.recent.append((int(s), {k: (v[0], v[1]) for k, v in rec.items()}))
        return meter


def _rank(x: float) -> float:
    """Order for peaks and largest ratios: a non-finite value above every finite one."""
    return x if math.isfinite(x) else math.inf


def _low(x: float) -> float:
    """Order for the smallest ratio: a non-finite value only when there is nothing else."""
    return x if math.isfinite(x) else math.inf
