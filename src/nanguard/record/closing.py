"""The report of a live run, built from its run log when the guard closes (or refines).

Plain inputs: the run log, what recovery cost, how the run ended. The diagnosis is made here
from the run log alone (`explain`, which never sees the guard).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanguard._version import __version__
from nanguard.record.events import Events
from nanguard.record.report import Report, build_report
from nanguard.record.runlog import RunLog
from nanguard.record.spike_run import measure_run
from nanguard.recover.verdict import LossWatch
from nanguard.watch.stats import StepStats


def recovery_summary(log: RunLog, losses: LossWatch,
                     cost: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """report.json's `run.recovery` after a skip or rollback: is the model back (`losses`,
    the loss levels before and since the trouble), and what recovering cost (updates
    discarded or undone, LR changes, snapshot memory). None when nothing was recovered from."""
    verdict = losses.verdict() if log.recovered_from else None
    if verdict is None:
        return None
    verdict["updates_skipped"] = sum(a["action"] == "skip" for a in log.actions)
    verdict.update(cost or {})
    return verdict


def run_report(log: RunLog, plain_log: Mapping[str, Any], *, optimizer: torch.optim.Optimizer,
               model: nn.Module, policy: str, entry: str, closed: bool, steps: int,
               ended: tuple[str, str | None], last: StepStats | None, losses: LossWatch,
               recovery_cost: Mapping[str, Any] | None, folder: Path | None,
               lead_window: int, error: dict[str, Any] | None,
               listener_errors: list[Any], sampling: dict[str, Any] | None = None) -> Report:
    """The report of the run `log` records (`plain_log`: its plain data, `Guard.run_log()`).

    Args:
        policy / entry / closed: report.json `run` fields (`entry`: `api` or `run`; `closed`:
            the guard closed, else a report of a run still going).
        ended: how the training ended, and its one-line error.
        last: the last recorded step (None: none was).
        losses / recovery_cost: for `recovery_summary`.
        error: nanguard's own error, when it stood down.
        sampling: report.json `sampling` (`nanguard.watch.sampling.Sampler.report`).
    """
    from nanguard.explain import diagnose
    from nanguard.explain.context import evidence_from_run

    how, message = ended
    recovery = recovery_summary(log, losses, recovery_cost)
    causes = diagnose(evidence_from_run(plain_log, optimizer))
    found = log.finding_dict()
    return build_report(
        steps=steps,
        alarms=[a.to_dict() for a in log.alarms],
        actions=list(log.actions),
        first_nonfinite=found,
        diagnosis=[c.to_dict() for c in causes],
        spikes=log.spikes,
        # From run.db, off the training thread; all steps are in it after close's flush.
        spike_measures=measure_run(folder),
        # Ended non-finite: the last recorded step still holds a NaN/Inf somewhere; or it
        # died of an error after a non-finite value appeared (BCE's range check, ...).
        failed=bool(last and last.nonfinite_signals())
        or (found is not None and how == "error")
        or (found is not None and last is None)
        or (recovery is not None and recovery["back"] is False),
        lead_window=lead_window,
        ended=how,
        degraded=error is not None,
        sampling=sampling,
        run={"folder": str(folder) if folder else None, "policy": policy,
             "model": type(model).__name__, "optimizer": type(optimizer).__name__,
             "version": __version__, "closed": closed, "entry": entry,
             "ended": {"how": how, "error": message},
             **({"recovery": recovery} if recovery else {}),
             **({"internal_error": error} if error else {}),
             **({"listener_errors": listener_errors} if listener_errors else {})},
    )


def announce_finding(events: Events, report: Report) -> None:
    """The `finding` event of a failed run, with its top cause (at close, after a refine).
    Not `notable` when the closing summary prints the finding anyway."""
    if report.status == "failed" and report.first_nonfinite is not None:
        events.finding(report.first_nonfinite, report.diagnosis[0] if report.diagnosis else None,
                       notable=not events.summary_follows)
