"""Merge the reports of several parts of one run (optimizers of a GAN, ranks of a torchrun job).

The merged `first_nonfinite` is the earliest one: the lowest step; at the same step the earliest
phase (data < forward < loss < backward < optimizer, unknown last); then the lowest rank. Under
DDP a NaN fed by one rank reaches every rank's gradients in the same step, so rank 0 sees it in
`backward` while the rank that read the bad batch saw it in `data`: the phase order names the
right rank. `ranks` lists every rank that saw it at that same step and phase.

Merging reads report.json files only (after every part has finished): it never talks to a
process group, so a dead rank cannot block it; a part that never wrote its report is rebuilt
from its run store (`load_report`), or listed under `run.missing`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nanguard.record.report import REPORT_NAME, Report, build_report, load_report
from nanguard.record.spike_run import merge_measures
from nanguard.runtime.distributed import PHASE_ORDER

SEVERITY = ("failed", "died", "degraded", "crashed", "interrupted", "unwatched", "recovered",
            "warned", "healthy")
"""Statuses from the worst to the best: a merged report takes the worst of its parts."""


def finding_key(first: dict[str, Any], order: int = 0) -> tuple[int, int, int, int]:
    """Sort key of a `first_nonfinite` entry: step, phase, rank (then the part's order). The
    step is `global_step` where the entry has one (the script's own count over all of its
    optimizers, `nanguard run`): each optimizer counts its own steps, so a critic's step 0
    and a generator's step 0 are not the same moment."""
    phase = first.get("phase")
    p = PHASE_ORDER.index(phase) if phase in PHASE_ORDER else len(PHASE_ORDER)
    rank = first.get("rank")
    step = first.get("global_step")
    if not isinstance(step, int):
        step = first.get("step")
    return (int(step or 0), p, int(rank) if isinstance(rank, int) else 0, order)


def merge_reports(parts: Sequence[tuple[str, Report]], run: dict[str, Any] | None = None) -> Report:
    """One report over `parts` (label, report); alarms and actions carry their part's label."""
    alarms: list[dict[str, Any]] = []
    actions: list[dict[str, Any]] = []
    found: list[tuple[tuple[int, int, int, int], str, Report]] = []
    for i, (label, report) in enumerate(parts):
        alarms += [{**a, "part": label} for a in report.alarms]
        actions += [{**a, "part": label} for a in report.actions]
        if report.first_nonfinite:
            found.append((finding_key(report.first_nonfinite, i), label, report))
    alarms.sort(key=lambda a: a.get("step", 0))
    actions.sort(key=lambda a: a.get("step", 0))
    first = None
    diagnosis: list[dict[str, Any]] = []
    if found:
        found.sort(key=lambda f: f[0])
        key, label, chosen = found[0]
        assert chosen.first_nonfinite is not None
        first = {**chosen.first_nonfinite, "part": label}
        ranks = sorted({
            f[0][2] for f in found if f[0][:2] == key[:2]
        })
        first["ranks"] = ranks
        diagnosis = list(chosen.diagnosis)
    else:
        diagnosis = next((list(r.diagnosis) for _, r in parts if r.diagnosis), [])
    info: dict[str, Any] = dict(run or {})
    info["parts"] = {
        label: {k: r.run.get(k) for k in ("folder", "model", "optimizer", "policy", "rank")
                if k in r.run} | {"status": r.status, "steps": r.steps}
        for label, r in parts
    }
    for _, r in parts:
        for k in ("policy", "version"):
            if k in r.run and k not in info:
                info[k] = r.run[k]
    merged = build_report(
        steps=max((r.steps for _, r in parts), default=0),
        alarms=alarms,
        actions=actions,
        first_nonfinite=first,
        diagnosis=diagnosis,
        run=info,
        spike_measures=merge_measures([(label, r.spike_measures) for label, r in parts]),
    )
    # How each part ended (crashed, interrupted, degraded, unwatched) is in its own status:
    # the merged one is the worst of them, never better than a part.
    merged.status = min((merged.status, *(r.status for _, r in parts)), key=_severity)
    return merged


def _severity(status: str) -> int:
    return SEVERITY.index(status) if status in SEVERITY else 0


def collect_rank_reports(
    out: Path, world: int, wait_s: float = 30.0, poll_s: float = 0.1
) -> tuple[list[tuple[str, Report]], list[int]]:
    """Read `out/rank-R/report.json` for every rank, waiting at most `wait_s` in all for the
    ranks that have not written theirs yet; then rebuild the missing ones from their store.

    Returns the (label, report) parts and the ranks for which nothing could be read.
    """
    deadline = time.monotonic() + wait_s
    folders = {r: out / f"rank-{r}" for r in range(world)}
    while time.monotonic() < deadline:
        if all((f / REPORT_NAME).is_file() for f in folders.values()):
            break
        time.sleep(poll_s)
    parts: list[tuple[str, Report]] = []
    missing: list[int] = []
    for r, folder in folders.items():
        try:
            report = load_report(folder)
        except Exception:  # noqa: BLE001 - a dead rank's half-written store
            missing.append(r)
            continue
        if report.first_nonfinite is not None and (
            report.first_nonfinite.get("rank") is None or not report.run.get("closed", True)
        ):
            report.first_nonfinite["rank"] = r  # rebuilt from the store: it knows no rank
        report.run.setdefault("rank", r)
        parts.append((f"rank-{r}", report))
    return parts, missing
