"""The end of a guard's run: the last reads, the report, and the run log as plain data.

`Guard.close`, `Guard.refine` and `Guard.run_log` call these with the guard's pipeline and
its `RunFacts`; the report itself is built from the run log alone (`record.closing`).
"""

from __future__ import annotations

from typing import Any

from nanguard.record.closing import announce_finding, run_report
from nanguard.record.report import Report
from nanguard.step.failopen import contain
from nanguard.step.pipeline import StepPipeline
from nanguard.step.state import RunFacts

__all__ = ["close_run", "finish", "publish", "run_log"]


def finish(pipe: StepPipeline) -> None:
    """At close: read every pending step, check what was handed to `watch` after the last
    step, and let the store write its last batch (a writer failure: degraded, not lost).
    Fails open (`step.failopen`): the report is written whatever happens here."""
    if pipe.error is not None:
        return
    try:
        pipe.flush()
        _check_leftover(pipe)
        pipe.parts.store.flush()
    except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
        contain(pipe, exc, "close")


def _check_leftover(pipe: StepPipeline) -> None:
    """A loss or batch handed to `watch` after the last optimizer step (the run died in its
    first iteration, or before the next step) is checked too, so a NaN that never reached an
    optimizer step is not lost. One host read, only when there is one."""
    parts, st = pipe.parts, pipe.state
    if parts.log.finding is not None:
        return
    stats = parts.steps.leftover(st.step, pipe.device, st.loss)
    st.loss = None
    if stats is not None and (stats.nonfinite_signals() or stats.nonfinite_samples):
        found = pipe.replays.locate(stats)
        found["signals"] = found["signals"] or ["data"]
        parts.log.set_finding(found, failing=stats)


def run_log(pipe: StepPipeline, facts: RunFacts) -> dict[str, Any]:
    """What the run has seen, as plain data (`Guard.run_log`)."""
    return pipe.parts.log.plain(
        optimizer=pipe.optimizer, params=pipe.state.params, detectors=pipe.parts.detectors,
        lead_window=pipe.config.detect.lead_window, facts=facts.as_log())


def publish(pipe: StepPipeline, facts: RunFacts, *, ended: tuple[str, str | None],
            close_store: bool = False) -> Report:
    """Diagnose and build the report from the run log, write report.json (then close the run
    store, at close: the report reads run.db first) and announce a failed run's finding."""
    parts, st = pipe.parts, pipe.state
    folder = parts.store.folder
    report = run_report(
        parts.log, run_log(pipe, facts), optimizer=pipe.optimizer, model=pipe.model,
        policy=pipe.config.policy, entry=facts.entry, closed=pipe.closed, steps=st.step,
        ended=ended, last=st.last_stats, losses=st.losses,
        recovery_cost=parts.recovery.cost(), folder=folder,
        lead_window=pipe.config.detect.lead_window, error=pipe.error,
        listener_errors=parts.events.errors, sampling=parts.steps.sampling())
    if folder is not None:
        report.write(folder)
    if close_store:
        parts.store.close()
    announce_finding(parts.events, report)
    return report


def close_run(pipe: StepPipeline, facts: RunFacts, ended: tuple[str, str | None]) -> Report:
    """Close `pipe`'s run: remove its hooks, read what is pending and what `watch` was handed
    after the last step, write the report and close the store; then tell the `close`
    listeners (a streaming exporter writes the finding, then finishes its tracker run)."""
    pipe.closed = True
    pipe.detach()
    pipe.parts.objective.close()  # no longer a peer of other guards (`detect.objective`)
    finish(pipe)  # fails open: a late error of nanguard's own still leaves a report
    events = pipe.parts.events
    events.tick(pipe.state.step, final=True)
    report = publish(pipe, facts, ended=ended, close_store=True)
    if events.close_listeners:
        events.close(pipe.state.step, report.to_dict())
    return report
