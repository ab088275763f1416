"""report.json: the stable summary of a run. Extend, never rename: the keys are described by the
JSON Schema shipped next to this module (report.schema.json, `nanguard report --schema`), and
`schema_version` grows when keys are added.

schema_version  SCHEMA_VERSION of the code that wrote it (0: written before it existed)
status          see STATUSES: "healthy" | "warned" | "failed" | "recovered" | "unwatched" |
                "degraded" | "crashed" | "interrupted" | "died" | "running"
steps           number of optimizer steps recorded
alarms          [{step, kind, signal, value, message}]
first_nonfinite null | {step, phase, module, op, source, samples, rank, signals, param};
                after an op-level replay also reproduced, node, inputs, kind, output,
                propagated_by, batch_item (see nanguard.pinpoint.Origin)
diagnosis       [{cause, confidence, evidence, fix}], best first; a `failed` run always has
                one: a cause, or `undetermined` saying what evidence was missing and how
                to get it (explain/undetermined.py)
actions         [{step, action, detail}]
first_warning   null | step of the first alarm that is not `nonfinite` (on a failed run:
                the first of the warnings that led into the first non-finite value, each
                within `lead_window` steps of the next, none at its own step:
                `record.lead.lead_in`)
lead_steps      null | first_nonfinite.step - first_warning (steps of warning)
spikes          [{step, layers, samples}]: where each spike alarm sits
preflight       null | the `nanguard run --preflight` verdict
spike_measures  null | spike score, episodes and time in spike of every run, healthy ones too
                (`nanguard.record.spikes`): {score: {loss, grad_norm, update_ratio} (share of
                scored steps, 0..1, null if none scored), spike_steps, steps_scored, episodes:
                [{start, value, baseline, peak_step, peak_value, recovered_at, recovery_steps,
                open, before: {signal: {ratio, steps_before, value, baseline, min_ratio}},
                at_jump: {signal: ratio}}], episodes_total, time_in_spike (0..1),
                steps_in_spike, steps, measured: {precursor: steps measured}, complete,
                definition: {window, min_window, sigmas, ..., text}}; null without a
                run.db; {error} if it could not be read
sampling        null | what was measured on sampled steps and how often
                (`nanguard.watch.sampling`): {every, signals: {optimizer_state,
                update_ratio, activations: stride or null}, every_step: [...], state_steps,
                state_why: {stride, alarm, save, nonfinite, close}}
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanguard.record import files
from nanguard.record.lead import lead_in
from nanguard.record.process import alive
from nanguard.record.spike_run import measure_run, merge_measures
from nanguard.record.store import dec, open_run, step_count

REPORT_NAME = files.REPORT_NAME

SCHEMA_VERSION = 3
"""The version of report.schema.json this code writes. Add 1 whenever a key is added (and
add the key to the schema: the suite validates every report it writes against it)."""

SCHEMA_NAME = "report.schema.json"


def report_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of report.json, as shipped in the package."""
    from importlib.resources import files as resources

    schema: dict[str, Any] = json.loads(
        resources("nanguard.record").joinpath(SCHEMA_NAME).read_text())
    return schema


STATUSES = {
    "healthy": "watched from the first to the last step; no alarm, nothing non-finite",
    "warned": "watched to the end; alarms (spike, cascade, ...) but nothing non-finite (a "
              "policy that acted on them without the loss coming back leaves it `warned`)",
    "recovered": "the policy (skip / rollback / heal) acted — on non-finite values or on the "
                 "early warnings before them — and the loss came back to its level before",
    "failed": "non-finite values appeared and the run ended with them or died of an error "
              "after them, or nanguard's `raise` policy (or a rollback give-up) stopped it",
    "unwatched": "no training step was watched (no optimizer step, no backward)",
    "degraded": "nanguard stood down after an error in its own hooks (traceback in "
                "nanguard_error.txt); training went on unwatched",
    "crashed": "the training ended by an error of its own; nothing non-finite was seen before",
    "interrupted": "SIGINT / SIGTERM ended the training; nothing non-finite was seen before",
    "died": "the process ended without closing the guard (SIGKILL, out of memory): no "
            "report.json was written; this one is rebuilt from run.db",
    "running": "the process that records it is still training (read from run.db so far)",
}
"""Every status report.json can hold, and what it promises."""

RECOVERING = ("skip", "rollback", "heal_clip", "wd_cut", "lr_cut", "lr_ramp")
"""Actions after which the run is recovering: its status is at least `recovered` (a policy
changed the training), and the report says whether the model came back."""

OK_STATUSES = ("healthy", "warned", "recovered")
"""Statuses a CI gate may pass: `nanguard report` exits 0 for these only."""


@dataclass(kw_only=True)
class Report:
    """The content of report.json."""

    schema_version: int = SCHEMA_VERSION
    """The version of report.schema.json this report follows."""
    status: str = "healthy"
    steps: int = 0
    alarms: list[dict[str, Any]] = field(default_factory=list)
    first_nonfinite: dict[str, Any] | None = None
    diagnosis: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    first_warning: int | None = None
    lead_steps: int | None = None
    spikes: list[dict[str, Any]] = field(default_factory=list)
    """Per spike alarm: `{step, layers: [{param, module, norm, baseline, ratio}], samples:
    [{index, norm, z}]}` (samples only with a `replay` function)."""
    preflight: dict[str, Any] | None = None
    """`nanguard run --preflight`: the verdict (findings, LR probe, overfit check, seconds);
    also under `run.preflight`."""
    spike_measures: dict[str, Any] | None = None
    """Spike score, episodes and time in spike, computed from run.db (`record/spike_run.py`);
    the module docstring of `nanguard.record.spikes` defines them."""
    run: dict[str, Any] = field(default_factory=dict)
    """Free-form run facts: folder, policy, model and optimizer class, nanguard version."""
    sampling: dict[str, Any] | None = None
    """What the watch sampled and how often (`nanguard.watch.sampling.Sampler.report`); None
    for a report rebuilt from run.db or written before schema_version 3."""

    def to_dict(self) -> dict[str, Any]:
        return _json_safe(asdict(self))

    def write(self, folder: str | os.PathLike[str]) -> Path:
        """Write report.json atomically (temp file + rename): a crash never leaves half a file."""
        path = Path(folder) / REPORT_NAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        os.replace(tmp, path)
        return path


def _json_safe(obj: Any) -> Any:
    """JSON has no NaN/Inf: write them as the strings "nan", "inf", "-inf"."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def build_report(
    *,
    steps: int,
    alarms: list[dict[str, Any]],
    actions: list[dict[str, Any]],
    first_nonfinite: dict[str, Any] | None,
    diagnosis: list[dict[str, Any]] | None = None,
    run: dict[str, Any] | None = None,
    failed: bool | None = None,
    lead_window: int = 10,
    spikes: list[dict[str, Any]] | None = None,
    ended: str = "ok",
    degraded: bool = False,
    spike_measures: dict[str, Any] | None = None,
    sampling: dict[str, Any] | None = None,
) -> Report:
    """Derive status, first warning and lead time from what was recorded.

    `ended` says how the training ended (`nanguard.record.ending.ENDINGS`), `degraded` that
    nanguard stood down after its own error. A non-finite value decides first (`failed` or
    `recovered`), then nanguard's own error, then how the training ended, then whether any
    step was watched at all."""
    warnings = [a["step"] for a in alarms if a["kind"] != "nonfinite"]
    lead = None
    if first_nonfinite is not None:
        nf = first_nonfinite["step"]
        first_warning = lead_in(warnings, nf, lead_window)
        lead = None if first_warning is None else nf - first_warning
    else:
        first_warning = min(warnings) if warnings else None
    # `failed`: the run ended non-finite (or was stopped). Unknown (a store rebuilt after a
    # crash): a non-finite value with no recovery action counts as a failure.
    kinds = {a["action"] for a in actions}
    stopped = bool(kinds & {"raise", "give_up"})
    # A finding in a batch the GradScaler skipped was stepped over too.
    # Any recovery action changed the training (heal's clip or LR cut too, even with no alarm
    # of its own): such a run is never `healthy`.
    recovering = bool(kinds & set(RECOVERING)) or bool(
        first_nonfinite and first_nonfinite.get("skipped_by"))
    if failed is None:
        failed = first_nonfinite is not None and not recovering
    stopped = stopped or ended == "stopped"
    if ended == "running":
        status = "running"  # what it has seen so far is all there in the other keys
    elif stopped or (first_nonfinite is not None and (failed or not recovering)):
        status = "failed"
    elif first_nonfinite is not None:
        status = "recovered"
    elif recovering:
        # The policy acted on early warnings (or for another optimizer of the same model):
        # `recovered` only if the loss came back (`failed` here: `run.recovery.back` False).
        status = "warned" if failed else "recovered"
    elif degraded:
        status = "degraded"
    elif ended == "error":
        status = "crashed"
    elif ended in ("interrupted", "died"):
        status = ended
    elif steps == 0:
        status = "unwatched"
    elif alarms:
        status = "warned"
    else:
        status = "healthy"
    if status == "failed" and not diagnosis:
        # Never a failed run without a cause: say what evidence was missing and how to get it.
        from nanguard.explain.undetermined import undetermined

        diagnosis = [undetermined(first_nonfinite, alarms=alarms, actions=actions,
                                  entry=str((run or {}).get("entry") or "api")).to_dict()]
    return Report(
        status=status,
        steps=steps,
        alarms=alarms,
        first_nonfinite=first_nonfinite,
        diagnosis=diagnosis or [],
        actions=actions,
        first_warning=first_warning,
        lead_steps=lead,
        spikes=list(spikes or []),
        spike_measures=spike_measures,
        run=run or {},
        sampling=sampling,
    )


def load_report(folder: str | os.PathLike[str]) -> Report:
    """Read report.json, or rebuild it from the store of a run that never closed (e.g. killed)."""
    path = Path(folder)
    if not path.exists():
        raise ValueError(f"no such run folder: {str(folder)!r}")
    report_path = path / REPORT_NAME
    if report_path.is_file():
        try:
            data = json.loads(report_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{str(report_path)!r} is not valid JSON ({exc})") from None
        first = data.get("first_nonfinite") if isinstance(data, dict) else None
        if not isinstance(data, dict) or (first is not None and not isinstance(first, dict)) or (
            isinstance(first, dict) and "step" not in first
        ):
            raise ValueError(f"{str(report_path)!r} is not a nanguard report")
        known = set(Report.__dataclass_fields__)
        # A report written before the schema existed says so (0), rather than claiming
        # the version of the code reading it.
        report = Report(**{"schema_version": 0, **{k: v for k, v in data.items() if k in known}})
        if "spike_measures" not in data:  # written before the measures existed
            report.spike_measures = measure_run(path)
        return report
    parts = _parts_in_progress(path)
    if parts:
        return _combine_parts(parts)
    db = open_run(path)
    try:
        steps = step_count(db)  # compacted steps included (record/compact.py)
        alarms = [
            {"step": s, "kind": k, "signal": g, "value": dec(v), "message": m}
            for s, k, g, v, m in db.execute("SELECT * FROM alarms ORDER BY step, rowid")
        ]
        actions = [
            {"step": s, "action": a, "detail": d}
            for s, a, d in db.execute("SELECT * FROM actions ORDER BY step, rowid")
        ]
        first = None
        for (body,) in db.execute("SELECT body FROM findings ORDER BY id LIMIT 1"):
            first = json.loads(body)
        if first is None:
            row = db.execute(
                "SELECT step, nonfinite FROM steps WHERE nonfinite != '[]' ORDER BY step LIMIT 1"
            ).fetchone()
            if row:
                # The batch rows the step found non-finite (its fingerprints' record): the
                # batch held the value, as the guard's own finding would have said.
                bad = db.execute("SELECT nonfinite_samples FROM batches WHERE step = ?",
                                 (row[0],)).fetchone()
                samples = json.loads(bad[0]) if bad and bad[0] else []
                first = {
                    "step": row[0],
                    "phase": "data" if samples else None,
                    "module": None,
                    "op": None,
                    "source": None,
                    "samples": samples,
                    "rank": 0,
                    "signals": json.loads(row[1]),
                }
        meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
    finally:
        db.close()
    run = {k: json.loads(v) for k, v in meta.items()}
    run["closed"] = False
    if "script" in run:  # `nanguard run` records the script it ran: fixes in its terms
        run.setdefault("entry", "run")
    # Not closed: still training (its process is alive on this host), or it died (SIGKILL,
    # out of memory) before it could write the report; what it recorded is all there is,
    # and it cannot be called healthy.
    ended = "running" if alive(run.get("process")) else "died"
    return build_report(steps=steps, alarms=alarms, actions=actions, first_nonfinite=first,
                        diagnosis=_diagnose_stored(first, alarms, actions, run),
                        run=run, ended=ended,
                        degraded="internal_error" in run, spike_measures=measure_run(path))


def _diagnose_stored(first: dict[str, Any] | None, alarms: list[dict[str, Any]],
                     actions: list[dict[str, Any]], run: dict[str, Any]) -> list[dict[str, Any]]:
    """The causes the stored finding and alarms support (a run whose process died before its
    report: no step history, no optimizer settings): a finding with its phase and samples, or
    its op and inputs, is explained as at close; without such evidence `build_report` adds
    the `undetermined` entry."""
    from nanguard.explain import diagnose
    from nanguard.explain.context import evidence_from_log

    if first is None and not alarms:
        return []
    log = {"first_nonfinite": first, "alarms": alarms, "actions": actions,
           "entry": run.get("entry"), "optimizer": {"name": run.get("optimizer")}}
    return [c.to_dict() for c in diagnose(evidence_from_log(log))]


def _parts_in_progress(path: Path) -> list[Path]:
    """`nanguard run` keeps each optimizer's (and rank's) record in a folder of its own while
    the script trains and lays the run folder out at the end: those part folders, when `path`
    has no record of its own yet."""
    if (path / files.DB_NAME).is_file():
        return []
    db = files.DB_NAME
    return sorted(p.parent for pattern in ("optimizer-*/" + db, "rank-*/" + db,
                                           "rank-*/optimizer-*/" + db)
                  for p in path.glob(pattern))


def _combine_parts(parts: list[Path]) -> Report:
    """One report over the parts of a run in progress: running while any part is, the
    earliest first non-finite value, every alarm and action."""
    reports = [load_report(p) for p in parts]
    if len(reports) == 1:
        return reports[0]
    firsts = [r.first_nonfinite for r in reports if r.first_nonfinite is not None]
    alarms = sorted((a for r in reports for a in r.alarms), key=lambda a: a["step"])
    actions = sorted((a for r in reports for a in r.actions), key=lambda a: a["step"])
    running = any(r.status == "running" for r in reports)
    return build_report(steps=max(r.steps for r in reports), alarms=alarms, actions=actions,
                        spike_measures=merge_measures([(str(p), r.spike_measures)
                                                       for p, r in zip(parts, reports,
                                                                       strict=True)]),
                        first_nonfinite=min(firsts, key=lambda f: f["step"]) if firsts else None,
                        ended="running" if running else "died",
                        run={"parts": {str(p): r.status for p, r in zip(parts, reports,
                                                                         strict=True)}})
