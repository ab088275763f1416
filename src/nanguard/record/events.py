"""Events: what the run tells the person (and their programs) while it goes.

Every alarm, action and finding the guard records is also an `Event`, handed as it happens to
the event listeners: the live log lines (`nanguard.show.live`), the user's `Guard(on_alarm=...,
on_action=..., on_finding=...)` callbacks and the exporters streaming into a tracker.

An *episode* groups the alarms of one trouble: it opens with the first alarm after a quiet
stretch and stays open while alarms keep coming (closing after `quiet_steps` steps without
one). Inside it an alarm is `notable` only when it is more severe than any before it (spike ->
cascade -> forecast -> overflow -> non-finite): that is what the live log shows, so a NaN that
persists for a thousand steps is one line (plus a count when the episode ends), never a flood.
Programs that want every alarm get every alarm; `notable` says which ones the log showed.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger("nanguard")

EVENT_TYPES = ("alarm", "action", "finding", "episode_end", "step", "close")

# How grave each alarm kind is: an episode's line repeats only when it gets graver.
SEVERITY = {
    "vanishing": 1, "saturation": 1, "lr_jump": 1, "amp_collapse": 2, "resume_loss": 2,
    "lr_jump_loss": 2,     "spike": 2, "divergence": 3,
    "cascade": 3, "forecast": 4, "overflow": 5, "replica_divergence": 5, "nonfinite": 6,
}
# Actions that are routine bookkeeping (the GradScaler's own overflow skips): logged at DEBUG.
ROUTINE_ACTIONS = ("amp_skip",)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One thing the run has to say, as it happens. Keys follow report.json where they exist."""

    type: str
    """One of EVENT_TYPES: `alarm`, `action`, `finding`, `episode_end` (an episode closed:
    how long, how many alarms, how many steps were non-finite) or `step` (a recorded step's
    signals in `data`, NaN kept; only to listeners that asked for steps) or `close` (the guard
    closed: report.json's dict in `data`, the status in `kind`; only to listeners that asked
    for it)."""
    step: int
    """0-based training step it belongs to (optimizer steps completed before it)."""
    kind: str
    """The alarm kind (`spike`, `nonfinite`, ...), the action (`skip`, `rollback`, `raise`,
    `give_up`, ...), the finding's cause (or its phase when no cause is known yet)."""
    signal: str = ""
    """What was measured (`grad_norm`, `loss`, ...) for an alarm; the op for a finding."""
    value: float | None = None
    """The number that raised an alarm; None for other events."""
    message: str = ""
    """One line a person can read."""
    notable: bool = True
    """Worth a line in the live log: an alarm that opens an episode or makes it graver; a
    finding not about to be printed in a closing summary anyway."""
    data: dict[str, Any] = field(default_factory=dict)
    """The full record: the alarm, action or finding as report.json holds it."""
    part: str | None = None
    """The part of the run it belongs to (`optimizer-1`) when a script trains with several
    optimizers (`Events.label`); None otherwise."""

    @property
    def level(self) -> int:
        """The `logging` level the live log uses for it."""
        if self.type == "alarm":
            return logging.ERROR if self.kind in ("nonfinite", "overflow") else logging.WARNING
        if self.type == "action":
            if self.kind in ROUTINE_ACTIONS:
                return logging.DEBUG
            return logging.ERROR if self.kind in ("raise", "give_up") else logging.WARNING
        if self.type == "episode_end":  # a NaN that persisted: its count is worth a line
            return logging.WARNING if (self.value or 0) > 1 else logging.INFO
        if self.type in ("step", "close"):
            return logging.DEBUG
        return logging.ERROR  # a finding


Listener = Callable[[Event], Any]


class Episodes:
    """Decides which alarms are notable (see the module docstring) and when an episode ends.

    Args:
        quiet_steps: steps without an alarm that close an episode.
    """

    quiet_steps: int
    start: int | None  # first step of the open episode (None: no episode open)
    last: int  # last step with an alarm in it
    worst: int  # severity of the gravest alarm so far in it
    count: int  # alarms in it
    nonfinite_steps: set[int]  # steps of it holding a non-finite value

    def __init__(self, quiet_steps: int = 20) -> None:
        self.quiet_steps = quiet_steps
        self.start = None
        self.last = -1
        self.worst = 0
        self.count = 0
        self.nonfinite_steps = set()

    def see(self, step: int, kind: str) -> bool:
        """Take one alarm; True when it opens an episode or makes it graver."""
        rank = SEVERITY.get(kind, 2)
        notable = self.start is None or rank > self.worst
        if self.start is None:
            self.start, self.worst, self.count = step, 0, 0
            self.nonfinite_steps = set()
        self.worst = max(self.worst, rank)
        self.count += 1
        self.last = max(self.last, step)
        if kind == "nonfinite":
            self.nonfinite_steps.add(step)
        return notable

    def tick(self, step: int, nonfinite: bool = False, final: bool = False) -> Event | None:
        """Step `step` is over (`nonfinite`: it still holds a NaN/Inf, alarmed or not, which
        keeps the episode open): the `episode_end` event when the open episode ends with it
        (`quiet_steps` steps without an alarm or a non-finite value, or `final`: the run is
        closing)."""
        if self.start is not None and nonfinite:
            self.nonfinite_steps.add(step)
            self.last = max(self.last, step)
        if self.start is None or not (final or step - self.last >= self.quiet_steps):
            return None
        start, last, nf = self.start, self.last, len(self.nonfinite_steps)
        self.start = None
        span = f"steps {start}-{last}" if last > start else f"step {start}"
        text = (f"{'the run ended inside' if final else 'quiet again after'} the episode of "
                f"{span}: {self.count} alarm(s)")
        if nf > 1:
            text += f", non-finite values in {nf} of its steps"
        return Event(type="episode_end", step=last, kind="nonfinite" if nf else "episode",
                     value=float(nf), message=text,
                     data={"start": start, "end": last, "alarms": self.count,
                           "nonfinite_steps": nf, "open_at_close": final})


class Events:
    """Hands each event to every listener; a listener that raises is dropped (its traceback
    logged once at ERROR) and training goes on, like any other error inside a monitor hook.

    Args:
        quiet_steps: see `Episodes`.
        summary_follows: a closing summary will print the finding (`RecordConfig.summary`):
            the finding's closing event is then not `notable` (see `summary_follows`).
    """

    episodes: Episodes
    listeners: list[Listener]
    step_listeners: list[Listener]
    """Listeners of `step` events (the per-step signals): none on most runs, and then the
    step costs nothing more."""
    close_listeners: list[Listener]
    """Listeners of the `close` event: told once, when the guard has closed (exporters finish
    the tracker run they opened)."""
    errors: list[dict[str, Any]]
    """Listeners dropped after an error: `{listener, step, error}` (in report.json
    `run.listener_errors`)."""

    def __init__(self, quiet_steps: int = 20, *, summary_follows: bool = False) -> None:
        self.episodes = Episodes(quiet_steps)
        self.listeners = []
        self.step_listeners = []
        self.close_listeners = []
        self.errors = []
        self._summary_follows = summary_follows
        self._hold = False
        self._held: tuple[dict[str, Any], dict[str, Any] | None] | None = None
        self._follows_said = False
        self._label: str | None = None

    @property
    def summary_follows(self) -> bool:
        """A closing summary prints the finding: its closing event is then not `notable`."""
        return self._summary_follows

    @property
    def hold(self) -> bool:
        """A re-run may still change the finding (`nanguard run`, until its epilogue has re-run
        the failing step or kept the in-process replay's origin): a finding leaves without a
        cause, once, saying the cause follows; the latest is held and leaves with its cause at
        `release()`. So no line names a cause the record later contradicts."""
        return self._hold

    @property
    def label(self) -> str | None:
        """This guard's part of a run with several optimizers (`optimizer-1`), carried by
        every event it emits: two guards' lines about one step read apart (`name_part`)."""
        return self._label

    def hold_findings(self) -> None:
        """Hold findings until `release()` (see `hold`). Called by `nanguard run` right after
        it builds a guard, before the guard's first step: its epilogue may re-run the
        failing step."""
        self._hold = True

    def name_part(self, label: str) -> None:
        """Carry `label` in every later event (see `label`). Called by `nanguard run` and the
        Lightning callback once a run has a second optimizer (before its first step)."""
        self._label = label

    def expect_summary(self, follows: bool) -> None:
        """Whether a closing summary prints the finding (see `summary_follows`). Called by
        `nanguard run` before it closes its guards: its own summary, not the guard's."""
        self._summary_follows = follows

    def add(self, listener: Listener, *, steps: bool = False, close: bool = False) -> None:
        """Subscribe `listener(event)` to every later event but `step` and `close` ones
        (`steps`: to the `step` events only; `close`: to the `close` event only)."""
        if not callable(listener):
            raise ValueError(f"an event listener must be callable, got {type(listener).__name__}")
        if steps and close:
            raise ValueError("a listener takes the step events or the close event, not both")
        (self.step_listeners if steps else self.close_listeners if close
         else self.listeners).append(listener)

    def subscribe(self, listener: Listener, only: str | None = None) -> None:
        """`Guard.add_listener`: subscribe `listener` to every later event but `step` and
        `close` ones, or with `only` to the events of that one type (`step` and `close` ones
        included). Raises ValueError, naming what to pass, on a listener that is not callable
        or an unknown type."""
        if not callable(listener):
            raise ValueError(f"a listener must be callable, got {type(listener).__name__}")
        if only not in (None, *EVENT_TYPES):
            raise ValueError(f"unknown event type {only!r}; use one of {', '.join(EVENT_TYPES)}")
        if only in (None, "step", "close"):
            self.add(listener, steps=only == "step", close=only == "close")
            return

        def typed(event: Event) -> None:
            if event.type == only:
                listener(event)

        # A listener that raises is named in report.json by this name: the user's, not ours.
        typed.__qualname__ = getattr(listener, "__qualname__", type(listener).__name__)
        self.add(typed)

    def step(self, step: int, signals: dict[str, float]) -> None:
        """A step was recorded: its signals (NaN and Inf as they are) to the step listeners."""
        self._emit(Event(type="step", step=step, kind="step", notable=False, data=signals),
                   self.step_listeners)

    def close(self, step: int, report: dict[str, Any]) -> None:
        """The guard closed (report.json written, `report` its dict): to the close listeners,
        once; nothing follows but a `refine`'s finding."""
        self._emit(Event(type="close", step=step, kind=str(report.get("status", "")),
                         message=f"run closed, status {report.get('status')}", notable=False,
                         data=report), self.close_listeners)

    def alarm(self, alarm: dict[str, Any], message: str | None = None, *,
              said: bool = False) -> Event:
        """An alarm was recorded (a dict with report.json's alarm keys); `message` replaces
        its text in the event (see `alarms`); `said`: its news already had a line of its own
        (a checkpoint mismatch, said when it was loaded), so the event is not `notable`."""
        notable = self.episodes.see(int(alarm["step"]), str(alarm["kind"])) and not said
        event = Event(type="alarm", step=int(alarm["step"]), kind=str(alarm["kind"]),
                      signal=str(alarm.get("signal", "")), value=alarm.get("value"),
                      message=message or str(alarm.get("message", "")), notable=notable,
                      data=dict(alarm))
        self.emit(event)
        return event

    def alarms(self, alarms: list[dict[str, Any]]) -> None:
        """The alarms of one step, in order. Several `nonfinite` ones (loss, gradients,
        parameters, optimizer state) are one trouble: the first says all of them, so the line
        the log shows names every signal that went non-finite in that step."""
        nonfinite = [a for a in alarms if a.get("kind") == "nonfinite"]
        summary = None
        if len(nonfinite) > 1:
            what = ", ".join(str(a.get("signal")) for a in nonfinite)
            summary = f"non-finite values at step {nonfinite[0]['step']} in: {what}"
        for a in alarms:
            self.alarm(a, summary if summary and a is nonfinite[0] else None)

    def action(self, step: int, action: str, detail: str) -> None:
        """An action was taken (skip, rollback, raise, give_up, ...)."""
        self.emit(Event(type="action", step=step, kind=action, message=detail,
                        data={"step": step, "action": action, "detail": detail}))

    def finding(self, finding: dict[str, Any], cause: dict[str, Any] | None = None,
                *, notable: bool = True, follows: bool = False) -> None:
        """Where the first non-finite value came from, and its top cause: `cause`, the
        record's diagnosis (the same computation report.json holds), or none yet (`follows`:
        the line says the cause follows, as it will at close). `notable` False when a closing
        summary prints it anyway. While `hold`, see there."""
        if self._hold:
            self._held = (finding, cause)
            if self._follows_said:
                return
            self._follows_said = True
            cause, follows = None, True
        self._finding(finding, cause, notable=notable, follows=follows)

    def release(self) -> None:
        """The finding is complete (`nanguard run` after its re-run): the held finding leaves
        with the record's cause (not `notable` when the closing summary prints it); later
        findings leave as they come."""
        held, self._held, self._hold = self._held, None, False
        if held is not None:
            self._finding(held[0], held[1], notable=not self._summary_follows, follows=False)

    def _finding(self, finding: dict[str, Any], cause: dict[str, Any] | None, *,
                 notable: bool, follows: bool) -> None:
        # Without an op, a loss/backward/forward phase is where the watched signals first
        # showed the value, not where an op made it: the op-level search may place it earlier
        # (a hand-written model's forward), so the line says "seen in", never a phase the
        # record would contradict. Where a value entered (data, a checkpoint) is definite.
        phase = finding.get("phase")
        seen = not finding.get("op") and phase in ("loss", "backward", "forward")
        where = " ".join(x for x in (
            (f"seen in the {phase}" if seen else f"phase {phase}") if phase else "",
            f"op {finding['op']}" if finding.get("op") else "",
            f"in {finding['module']!r}" if finding.get("module") else "",
            f"at {finding['source']}" if finding.get("source") else "",
            f"samples {finding['samples'][:8]}" if finding.get("samples") else "",
        ) if x)
        text = f"first non-finite value at step {finding.get('step')}: {where or 'located'}"
        if cause:
            text += (f"; cause {cause.get('cause')} ({cause.get('confidence', 0):.0%})"
                     f"; fix: {cause.get('fix')}")
        elif follows:
            text += "; the cause follows"
        self.emit(Event(type="finding", step=int(finding.get("step") or 0),
                        kind=str((cause or {}).get("cause") or finding.get("phase") or ""),
                        signal=str(finding.get("op") or ""), message=text, notable=notable,
                        data={"first_nonfinite": finding, "cause": cause}))

    def tick(self, step: int, nonfinite: bool = False, final: bool = False) -> None:
        """After each recorded step (and at close, `final`): end a quiet episode."""
        event = self.episodes.tick(step, nonfinite, final)
        if event is not None:
            self.emit(event)

    def emit(self, event: Event) -> None:
        """Hand `event` to every listener (not the step listeners)."""
        self._emit(event, self.listeners)

    def _emit(self, event: Event, listeners: list[Listener]) -> None:
        if self._label is not None and event.part is None:
            event = replace(event, part=self._label)
        for listener in list(listeners):
            try:
                listener(event)
            except Exception as exc:  # noqa: BLE001 - a listener never breaks training
                listeners.remove(listener)
                name = getattr(listener, "__qualname__", None) or type(listener).__name__
                self.errors.append({"listener": name, "step": event.step,
                                    "error": f"{type(exc).__name__}: {exc}"})
                log.error("nanguard: event listener %s raised at step %d and was removed; "
                          "training goes on\n%s", name, event.step,
                          "".join(traceback.format_exception(type(exc), exc,
                                                             exc.__traceback__)).rstrip())
