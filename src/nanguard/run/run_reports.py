"""The guards' reports once the script has ended, and the run folder they are written to.

Called by run/runner.py after the script, in this order: `late_finding` turns a
non-finite value the script held at its end (that no guarded step recorded) into a finding,
attaching a guard when none was; `settle_in_process` keeps each guard's in-process origin or
puts its finding back as the watched signals gave it, saying why; `close_guards` closes every
guard with how the script ended; `first_failure` picks the part the re-run pinpoints and
`refine` folds the re-run's origin into that guard's finding; `write_folder` lays out this
process's run folder (one optimizer: DIR itself; several: DIR/optimizer-N and a merged
DIR/report.json; under torchrun DIR/rank-R) and returns its report. `world` and `default_out`
say which rank this process is and where the folder goes when none was given.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from nanguard.pinpoint.recorded import NotReplayable
from nanguard.record.merge import finding_key, merge_reports
from nanguard.record.report import REPORT_NAME, Report
from nanguard.run.chains import chain_note, chains
from nanguard.run.discovery import Discovery
from nanguard.run.run_output import ScriptOutcome
from nanguard.run.watched import Watched

__all__ = ["close_guards", "default_out", "failing_step", "first_failure", "found_in_process",
           "late_finding", "refine", "set_finding", "settle_in_process", "world", "write_folder"]


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun sets RANK, WORLD_SIZE)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def default_out(world_size: int) -> Path:
    """The run folder when none was given: `nanguard_runs/<time>`, or under torchrun one
    folder all ranks agree on without talking."""
    base = Path("nanguard_runs")
    if world_size > 1:
        # Every rank must pick the same folder without talking: the launcher's run id (or its
        # pid, the parent of every local rank).
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return base / f"torchrun-{run_id if run_id not in ('', 'none') else os.getppid()}"
    return base / time.strftime("%Y%m%d-%H%M%S")


def close_guards(disc: Discovery, outcome: ScriptOutcome) -> dict[int, Report]:
    """Close every guard, telling it how the script ended."""
    reports: dict[int, Report] = {}
    for w in disc.watched:
        if w.guard is None:
            continue
        reports[w.index] = _close_guard(w, outcome)
    return reports


def _close_guard(w: Watched, outcome: ScriptOutcome) -> Report:
    guard = w.guard
    assert guard is not None
    return guard.close(ended=outcome.ended, error=outcome.message)


def late_finding(disc: Discovery, outcome: ScriptOutcome, rank: int
                  ) -> tuple[Watched, dict[str, Any]] | None:
    """The finding for a non-finite value the script held when it ended that no guarded step
    recorded, and the part it belongs to (a guard attached now if none was); None if none."""
    if outcome.evidence is None:
        return None
    try:
        w = disc.attach_unstepped()
    except Exception:  # noqa: BLE001 - fail open: the evidence is still reported
        w = None
    if w is None or w.guard is None:
        return None
    step = w.guard.step
    evidence = outcome.evidence
    # A raised forward that held the value names its phase and module (held.py); the re-run
    # then names the op.
    finding = {"step": step, "phase": evidence.get("phase"), "module": evidence.get("module"),
               "op": None, "source": None, "samples": [], "rank": rank,
               "signals": list(evidence["signals"]), "after_last_step": True}
    return w, finding


def set_finding(w: Watched, finding: dict[str, Any]) -> Report:
    """Make `finding` the finding of `w`'s (closed) guard and diagnose it again."""
    guard = w.guard
    assert guard is not None
    return guard.refine(finding)


_REPLAYED_PHASES = ("forward", "loss", "backward")
"""Phases an in-process replay of the step's forward and backward can name for good."""


def settle_in_process(w: Watched) -> None:
    """After the script: keep the guard's in-process origin, or, when there is none to keep
    (the step could not be replayed, ran clean, or did not give the same loss bit for bit), put
    the finding back as the watched signals gave it and say why (`w.in_process["reason"]`)."""
    info, guard = w.in_process, w.guard
    if info is None or guard is None or guard.first_nonfinite is None:
        return
    first = guard.first_nonfinite  # a copy: set back below when it changes
    error = first.pop("replay_error", None)
    changed = error is not None  # the report of a closed guard still holds it
    if changed:
        guard.first_nonfinite = first
    if error is not None and str(error).startswith(NotReplayable.__name__):
        info.setdefault("reason", str(error).partition(": ")[2])
    elif error is not None:
        info.setdefault("reason", f"the in-process replay failed: {error}")
    elif first.get("op") and first.get("phase") in _REPLAYED_PHASES:
        if first.get("reproduced") is not False:
            info["found"] = True
            return
        info["reason"] = ("the in-process replay did not give the step's loss bit for bit "
                          "(state changed between the forward and the update?)")
    info.setdefault("reason", "the in-process replay found no op that made the value in that "
                    "step (it came with the step's inputs?)")
    if first != info["before"]:
        guard.first_nonfinite = dict(info["before"])
        changed = True
    if not changed:
        return
    if guard.closed:
        # The `raise` policy closed the guard (and its store) while the script ran: the
        # finding goes into its report instead, diagnosed again.
        guard.refine(guard.first_nonfinite)
    else:
        guard.store.write_finding(guard.first_nonfinite)


def failing_step(w: Watched) -> int:
    """The step of `w`'s first non-finite value (it must have one)."""
    assert w.guard is not None and w.guard.first_nonfinite is not None
    return int(w.guard.first_nonfinite["step"])


def found_in_process(w: Watched) -> bool:
    """The guard's in-process replay named the origin (`settle_in_process` kept it)."""
    return bool(w.in_process and w.in_process.get("found") and w.guard is not None
                and w.guard.first_nonfinite is not None)


def first_failure(watched: list[Watched], reports: dict[int, Report]) -> Watched | None:
    """The part whose first non-finite value came first (as merged reports order them),
    or None."""
    found = [
        (finding_key(_with_global_step(w, r.first_nonfinite), i), w)
        for i, w in enumerate(watched)
        if (r := reports.get(w.index)) is not None and r.first_nonfinite
    ]
    return min(found, key=lambda f: f[0])[1] if found else None


def _with_global_step(w: Watched, first: dict[str, Any]) -> dict[str, Any]:
    """`first` with `global_step` (the script's step count over all optimizers when the part's
    step began) where it is known: what orders the parts' findings in time."""
    step = first.get("step")
    at = w.global_step(step) if isinstance(step, int) else None
    return first if at is None else {**first, "global_step": at}


def refine(w: Watched, origin: dict[str, Any]) -> Report:
    """Fold the re-run's origin into the guard's finding and diagnose it again."""
    guard = w.guard
    assert guard is not None and guard.first_nonfinite is not None
    first = guard.first_nonfinite
    keep = {k: first.get(k) for k in ("step", "rank", "signals")}
    if first.get("samples"):
        # The guard's rows are rows of the step's batch (what `samples` means); the re-run may
        # have met the value earlier, in the whole data set a collate function reads from:
        # those rows are kept apart.
        keep["samples"] = first["samples"]
        if origin.get("samples") and origin["samples"] != first["samples"]:
            keep["origin_rows"] = origin["samples"]
    first.update({k: v for k, v in origin.items() if v is not None and v != []})
    if origin.get("op") is not None:
        # The op's own module, None outside every module (the script's loss code): not the
        # module whose output held the value at the end (`Discovery.nonfinite_evidence`).
        first["module"] = origin.get("module")
    first.update(keep)
    return guard.refine(first)


def write_folder(
    folder: Path,
    watched: list[Watched],
    reports: dict[int, Report],
    outcome: ScriptOutcome,
    replay: dict[str, Any] | None,
    *,
    preflight: dict[str, Any] | None = None,
    internal_error: dict[str, Any] | None = None,
    resume: dict[str, Any] | None = None,
) -> Report:
    """Lay out this process's run folder; return its report (merged over optimizers); the
    preflight's verdict goes under `run.preflight`; `internal_error` is an error of the
    runner's own hooks (nanguard stood down; with no guard yet, the run is `degraded`)."""
    errors = {w.name: w.error for w in watched if w.error}
    if len(reports) == 1:
        (index, report), = reports.items()
        w = next(w for w in watched if w.index == index)
        _move_into(w.folder, folder)
        report.run["folder"] = str(folder)
    elif reports:
        for w in watched:
            r = reports.get(w.index)
            if r is not None:
                r.run["folder"] = str(w.folder)
                if r.first_nonfinite:  # what orders the parts' findings in time
                    r.first_nonfinite = _with_global_step(w, r.first_nonfinite)
                r.write(w.folder)
        parts = [(w.name, reports[w.index]) for w in watched if w.index in reports]
        report = merge_reports(parts, {"folder": str(folder)})
        _note_chains(report, watched)
    elif internal_error is not None:
        report = Report(status="degraded",
                        run={"folder": str(folder), "internal_error": internal_error,
                             "note": "nanguard stood down before it watched a step"})
    else:
        report = Report(status="unwatched",
                        run={"folder": str(folder), "note": "no optimizer stepped"})
    report.run["script"] = outcome.to_dict()
    notes = [w.note for w in watched if w.note]
    if notes:
        report.run["notes"] = notes
    if replay is not None:
        report.run["replay"] = {k: v for k, v in replay.items() if k != "origin"}
        _why_undetermined(report, replay)
    if errors:
        report.run["errors"] = errors
    if resume is not None:
        report.run["resume_points"] = resume
    if preflight is not None:
        report.run["preflight"] = preflight
        report.preflight = preflight
    rank, world_size = world()
    if world_size > 1:
        report.run["rank"] = rank
    report.write(folder)
    return report


def _note_chains(report: Report, watched: list[Watched]) -> None:
    """Optimizers built one after the other over the same parameters (`chains`): the merged
    report counts their steps together, names the chain (`run.optimizer_chains`) and the
    summary says what it cost (a note on the chain's last part)."""
    found = chains(watched)
    if not found:
        return
    for chain in found:
        note = chain_note(chain)
        last = chain[-1]
        last.note = f"{last.note}; {note}" if last.note else note
        report.steps = max(report.steps, sum(len(w.starts) for w in chain))
    report.run["optimizer_chains"] = [[w.name for w in chain] for chain in found]


def _why_undetermined(report: Report, replay: dict[str, Any]) -> None:
    """An `undetermined` diagnosis says why the re-run could not give the op, when it tried."""
    reason = replay.get("reason") or replay.get("in_process")
    for entry in report.diagnosis:
        if entry.get("cause") == "undetermined" and reason and reason not in entry["evidence"]:
            entry["evidence"] += f" (the re-run: {reason})"


def _move_into(src: Path, dst: Path) -> None:
    """Move a single optimizer's record up into the run folder (report.json is rewritten)."""
    if not src.is_dir() or src == dst:
        return
    for item in src.iterdir():
        if item.name == REPORT_NAME:
            continue
        target = dst / item.name
        if target.exists():
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
        shutil.move(str(item), str(target))
    shutil.rmtree(src, ignore_errors=True)
