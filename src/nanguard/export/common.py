"""What every exporter writes: read once from a run folder (run.db + report.json), or
taken live from a guard's listeners (`Stream`).

Trackers differ in how they store a value and a text, not in what nanguard has to say: the
per-step signals (NaN/Inf kept), the 0/1 `nonfinite` and `skipped` markers, and one markdown
text per event (alarms and actions grouped by step, the first non-finite value, the diagnosis,
the closing report). No tracker is imported here.
"""

from __future__ import annotations

import atexit
import json
import math
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.record.report import REPORT_NAME
from nanguard.record.spikes import SpikeMeter
from nanguard.record.store import DB_NAME, dec, open_run, step_columns

if TYPE_CHECKING:
    from nanguard.guard import Guard
    from nanguard.record.events import Event as LiveEvent

SIGNALS = ("loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm",
           "second_moment_norm", "act_max", "attn_logit_max", "lr")
"""Per-step columns of run.db exported as scalars (named `nanguard/<name>`)."""


@dataclass(frozen=True)
class Step:
    """One optimizer step of a recorded run.

    Attributes:
        step: the guard's step number.
        time: wall-clock time of the step (seconds since the epoch), None if not recorded.
        values: signal name -> value (NaN and +-Inf as they are); signals not recorded absent.
        nonfinite: something watched was non-finite at this step.
        skipped: the update of this step was discarded.
        spikes: the spike measures up to this step (`SpikeMeter.now`: `in_spike`,
            `spike_episodes`, `time_in_spike`, `spike_score_<signal>`).
    """

    step: int
    time: float | None
    values: dict[str, float]
    nonfinite: bool
    skipped: bool
    spikes: dict[str, float] = field(default_factory=dict)

    def markers(self) -> dict[str, float]:
        """The finite 0/1 marker series, plotted where the value itself cannot be."""
        return {"nonfinite": 1.0 if self.nonfinite else 0.0,
                "skipped": 1.0 if self.skipped else 0.0}

    def scalars(self) -> dict[str, float]:
        """The values, the markers and the spike measures, named `nanguard/<name>` as every
        exporter writes them."""
        return {f"nanguard/{k}": v
                for k, v in {**self.values, **self.markers(), **self.spikes}.items()}


@dataclass(frozen=True)
class Event:
    """One text event: `tag` is alarms, actions, first_nonfinite, diagnosis or report."""

    step: int
    tag: str
    text: str


@dataclass
class RunData:
    """A run folder's steps, events and report, as exporters need them."""

    steps: list[Step]
    events: list[Event]
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max((s.step for s in self.steps), default=0)


def run_parts(run: str | Path) -> list[tuple[str | None, Path]]:
    """The recorded folders of a run: itself, or its `rank-R/` parts when merged from ranks.

    Returns:
        (part name or None for a single folder, folder) pairs.

    Raises:
        ValueError: `run` is not a nanguard run folder.
    """
    folder = Path(run)
    if (folder / DB_NAME).exists():
        return [(None, folder)]
    parts = sorted(p for p in folder.glob("rank-*") if (p / DB_NAME).exists())
    if not parts:
        raise ValueError(f"{str(folder)!r} is not a nanguard run folder (no {DB_NAME} in it)")
    return [(p.name, p) for p in parts]


def load_run(folder: Path) -> RunData:
    """Read one recorded folder (holding run.db) into steps and events."""
    db = open_run(folder)
    try:
        have = step_columns(db)  # a store written before a signal existed lacks its column
        cols = ", ".join(c if c in have else "NULL" for c in SIGNALS)
        rows = db.execute(
            f"SELECT step, time, {cols}, nonfinite, skipped FROM steps ORDER BY step").fetchall()
    finally:
        db.close()
    steps = []
    # The spike measures step by step, as a live stream plots them. Over the steps run.db
    # still holds: on a compacted run (over `RecordConfig.compact_after` steps) the thinned
    # part counts less than report.json's `spike_measures`, which counted every step.
    meter = SpikeMeter()
    for row in rows:
        values = {}
        for name, raw in zip(SIGNALS, row[2:2 + len(SIGNALS)], strict=True):
            value = dec(raw)
            if value is not None:
                values[name] = value
        flagged = json.loads(row[-2] or "[]")
        nonfinite = bool(flagged) or any(not math.isfinite(v) for v in values.values())
        meter.update(int(row[0]), values)
        steps.append(Step(int(row[0]), None if row[1] is None else float(row[1]), values,
                          nonfinite, bool(row[-1]), meter.now()))
    report: dict[str, Any] = {}
    if (folder / REPORT_NAME).exists():
        report = json.loads((folder / REPORT_NAME).read_text())
    data = RunData(steps, [], report)
    data.events = events(report, data.last_step)
    return data


def events(report: dict[str, Any], last: int) -> list[Event]:
    """The report's events as markdown texts at their steps, in step order.

    Alarms and actions are grouped per step (one text each); the first non-finite value and the
    diagnosis sit at the step of the first non-finite value (else the last step); the report
    (status and every event) at the last step.
    """
    out: list[Event] = []
    grouped: dict[str, dict[int, list[str]]] = {"alarms": {}, "actions": {}}
    for a in report.get("alarms", []):
        grouped["alarms"].setdefault(int(a["step"]), []).append(
            f"- **{a['kind']}** `{a['signal']}` = {a.get('value')}: {a.get('message', '')}")
    for a in report.get("actions", []):
        grouped["actions"].setdefault(int(a["step"]), []).append(
            f"- **{a['action']}**: {a.get('detail', '')}")
    for tag, by_step in grouped.items():
        out += [Event(step, tag, "\n".join(lines)) for step, lines in sorted(by_step.items())]
    first = report.get("first_nonfinite")
    at = int(first.get("step", last)) if first else last
    if first:
        keys = ("phase", "module", "op", "source", "samples", "param", "rank", "signals")
        table = "\n".join(f"| {k} | `{first[k]}` |" for k in keys if first.get(k) is not None)
        out.append(Event(at, "first_nonfinite", f"**first non-finite value at step {at}**\n\n"
                         f"| key | value |\n| --- | --- |\n{table}"))
    diagnosis = report.get("diagnosis") or []
    if diagnosis:
        out.append(Event(at, "diagnosis", "\n".join(
            f"{i + 1}. **{c['cause']}** ({c.get('confidence', '')}): {c.get('fix', '')}"
            for i, c in enumerate(diagnosis))))
    if report:
        lines = [f"- step {a['step']}: alarm {a['kind']}:{a['signal']}"
                 for a in report.get("alarms", [])]
        lines += [f"- step {a['step']}: action {a['action']}" for a in report.get("actions", [])]
        out.append(Event(last, "report", f"**status: {report.get('status')}**, "
                         f"{report.get('steps')} steps\n\n" + "\n".join(lines)))
    out.sort(key=lambda e: e.step)
    return out


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """Flat run-level facts (status, first non-finite step/phase/module/op, top cause)."""
    out: dict[str, Any] = {}
    if not report:
        return out
    out["status"] = report.get("status")
    first = report.get("first_nonfinite") or {}
    for key in ("step", "phase", "module", "op"):
        if first.get(key) is not None:
            out[f"first_nonfinite_{key}"] = first[key]
    diagnosis = report.get("diagnosis") or []
    if diagnosis:
        out["top_cause"] = diagnosis[0]["cause"]
    m = report.get("spike_measures") or {}
    if "episodes_total" in m:  # every step counted (report.json's, not the per-step series)
        out["spike_episodes"] = m["episodes_total"]
        out["time_in_spike"] = m.get("time_in_spike")
        for k, v in (m.get("score") or {}).items():
            if v is not None:
                out[f"spike_score_{k}"] = v
    return out


# The text tag each live event type is written under (the after-the-fact names where they exist).
LIVE_TAGS = {"alarm": "alarms", "action": "actions", "finding": "first_nonfinite",
             "episode_end": "episodes"}


def live_line(event: LiveEvent) -> str:
    """One markdown line for a live event (the after-the-fact exporters' wording)."""
    if event.type == "alarm":
        return f"- **{event.kind}** `{event.signal}` = {event.value}: {event.message}"
    if event.type == "action":
        return f"- **{event.kind}**: {event.message}"
    return f"- {event.message}"


class Stream:
    """Base of the live exporters: subscribes to a guard and hands each tracker what to write.

    A recorded step's signals reach `write` as scalars `nanguard/<signal>` (NaN/Inf as they are,
    plus the 0/1 `nanguard/nonfinite` and `nanguard/skipped` and the spike measures so far,
    `SpikeMeter.now`: `nanguard/in_spike`, `nanguard/spike_score_loss`, ...), together with the
    texts of the events of that step: the guard announces a step's alarms and actions before the
    step itself, so they are held until it comes and one text per tag and step is written. An
    event of a step already written (the finding, told at close; an episode's end, told once
    quiet) is written at once. When the guard closes, the held texts, the closing report (and
    the diagnosis) are written and `finish` ends what the stream opened. A tracker error drops
    the listener that met it (logged once by the guard); training goes on. A guard left open at
    exit is closed by the stream's own exit hook, which runs before the tracker's (registered
    earlier, when its run started), so the report still reaches a run the tracker has not torn
    down yet.

    Args:
        guard: the guard to follow; it must not be closed yet.
    """

    def __init__(self, guard: Guard) -> None:
        self.check(guard)
        self.last = -1  # last step written
        self.closed = False
        self._held: dict[int, dict[str, list[str]]] = {}
        self.meter = SpikeMeter()  # O(1) a step, on the training thread only when streaming
        guard.add_listener(self._on_step, only="step")
        guard.add_listener(self._on_event)
        guard.add_listener(self._on_close, only="close")
        ref = weakref.ref(guard)
        self._at_exit = lambda: (g := ref()) is not None and g.close()
        atexit.register(self._at_exit)

    @staticmethod
    def check(guard: Guard) -> None:
        """Refuse a closed guard (before a tracker run is opened for it).

        Raises:
            ValueError: the guard is closed.
        """
        if guard.closed:
            raise ValueError("this Guard is closed: stream a guard before training with it")

    # -- what a tracker implements
    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        """Write one step's scalars and event texts (tag -> markdown; both may be empty)."""
        raise NotImplementedError

    def finish(self, report: dict[str, Any] | None) -> None:
        """The guard closed (`report`: its report.json dict) or `close()` was called (None):
        flush, and end the tracker run if the stream opened it (never the user's own)."""
        raise NotImplementedError

    # -- listeners
    def _on_step(self, event: LiveEvent) -> None:
        if self.closed:
            return
        texts = self._take(event.step)
        self.meter.update(event.step, event.data)
        scalars = {f"nanguard/{k}": float(v) for k, v in {**event.data,
                                                          **self.meter.now()}.items()}
        self.write(event.step, scalars, texts)
        self.last = max(self.last, event.step)

    def _on_event(self, event: LiveEvent) -> None:
        tag = LIVE_TAGS.get(event.type)
        if self.closed or tag is None:
            return
        self._held.setdefault(event.step, {}).setdefault(tag, []).append(live_line(event))
        if event.step <= self.last:  # its step is written already: no reason to wait
            self.write(event.step, {}, self._take(event.step))

    def _on_close(self, event: LiveEvent) -> None:
        if self.closed:
            return
        self._drain()
        report = event.data
        at = max(self.last, 0)
        for e in events(report, at):
            if e.tag in ("diagnosis", "report"):
                self.write(e.step, {}, {e.tag: e.text})
        self.closed = True
        atexit.unregister(self._at_exit)
        self.finish(report)

    def _take(self, step: int) -> dict[str, str]:
        """The held texts of `step` and any step before it, joined per tag."""
        out: dict[str, list[str]] = {}
        for s in sorted(k for k in self._held if k <= step):
            for tag, lines in self._held.pop(s).items():
                out.setdefault(tag, []).extend(lines if s == step else
                                               [f"(step {s}) {ln}" for ln in lines])
        return {tag: "\n".join(lines) for tag, lines in out.items()}

    def close(self) -> None:
        """Stop streaming now (the guard's close does it otherwise): write what is held and
        end the tracker run the stream opened. Safe to call more than once."""
        if self.closed:
            return
        self._drain()
        self.closed = True
        atexit.unregister(self._at_exit)
        self.finish(None)

    def _drain(self) -> None:
        """Write every held text, each at its own step."""
        while self._held:
            step = min(self._held)
            self.write(step, {}, self._take(step))
