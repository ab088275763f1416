"""Audit a checkpoint offline: every tensor finite, magnitudes plausible against its peers,
optimizer state sane, a content hash per tensor; and the diff of two checkpoints.

Tensors are read a chunk at a time (see `ckpt_load`), so a large safetensors file is audited
in bounded memory. Nothing here executes pickled code.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nanguard.audit.ckpt_load import Source, new_digest, open_checkpoint, update_digest
from nanguard.audit.common import AuditFinding, AuditInputError, FieldsToDict, progress, robust_z
from nanguard.audit.manifest import ManifestCheck, load_manifest_for, scalar_entries

# Optimizer state that is a running mean of squares: a negative value is impossible and
# makes Adam's sqrt NaN on the next step.
_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "acc_delta")
# A tensor is an outlier among its peers when its log10 magnitude is this far from their
# median (100x) AND this many robust standard deviations away: both, so that a tight peer
# group cannot flag a 3x difference and a loose one cannot hide a 1e6x one.
OUTLIER_DECADES = 2.0
OUTLIER_Z = 5.0
MIN_PEERS = 3


@dataclass(kw_only=True)
class TensorStats(FieldsToDict):
    """Statistics of one tensor. Magnitudes are over its finite values; None if it has none."""

    name: str
    dtype: str
    shape: list[int]
    numel: int
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    negative: int = 0
    absmax: float | None = None
    rms: float | None = None
    sha256: str = ""

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf


@dataclass(kw_only=True)
class CheckpointReport:
    """What `audit_checkpoint` found in one file."""

    path: str
    format: str
    tensors: list[TensorStats] = field(default_factory=list)
    findings: list[AuditFinding] = field(default_factory=list)
    manifest: ManifestCheck | None = None
    """The comparison with the checkpoint's manifest, when it has one (its mismatches are
    also `manifest_mismatch` findings)."""

    @property
    def ok(self) -> bool:
        return not any(f.severity in ("error", "warning") for f in self.findings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "tensors": [t.to_dict() for t in self.tensors],
            "findings": [f.to_dict() for f in self.findings],
            "manifest": self.manifest.to_dict() if self.manifest else None,
        }


@dataclass(kw_only=True)
class TensorChange(FieldsToDict):
    """How one tensor differs between two checkpoints."""

    name: str
    status: str  # changed | added | removed | reshaped
    max_abs_diff: float | None = None
    rel_change: float | None = None  # ||b - a|| / ||a|| over positions finite in both
    became_nonfinite: bool = False


@dataclass(kw_only=True)
class DiffReport:
    """The audits of two checkpoints and the tensors that differ between them."""

    a: CheckpointReport
    b: CheckpointReport
    changes: list[TensorChange] = field(default_factory=list)
    unchanged: int = 0
    findings: list[AuditFinding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.a.ok and self.b.ok and not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "a": self.a.to_dict(),
            "b": self.b.to_dict(),
            "changes": [c.to_dict() for c in self.changes],
            "unchanged": self.unchanged,
            "findings": [f.to_dict() for f in self.findings],
        }


def _as_float64(chunk: Any) -> Any:
    import torch

    if chunk.is_complex():
        return chunk.abs().to(torch.float64)
    return chunk.to(torch.float64)


def tensor_stats(source: Source, name: str, bar: Any = None) -> TensorStats:
    """Stream one tensor and compute its statistics and content hash."""
    import torch

    dtype, shape = source.meta(name)
    stats = TensorStats(name=name, dtype=dtype, shape=list(shape), numel=math.prod(shape))
    digest = new_digest(dtype, shape)
    absmax, sumsq, finite_n = -math.inf, 0.0, 0
    for chunk in source.chunks(name):
        raw = update_digest(digest, chunk)
        x = _as_float64(raw)
        finite = torch.isfinite(x)
        nfin = int(finite.sum())
        if nfin < x.numel():
            stats.nan += int(torch.isnan(x).sum())
            stats.posinf += int(torch.isposinf(x).sum())
            stats.neginf += int(torch.isneginf(x).sum())
            x = x[finite]
        if nfin:
            absmax = max(absmax, float(x.abs().max()))
            sumsq += float((x * x).sum())
            stats.negative += int((x < 0).sum())
            finite_n += nfin
        if bar is not None:
            bar.advance(raw.numel() * raw.element_size())
    stats.sha256 = digest.hexdigest()
    if finite_n:
        stats.absmax, stats.rms = absmax, math.sqrt(sumsq / finite_n)
    return stats


def _is_optimizer_state(name: str) -> bool:
    return ".state." in f".{name}" and not name.endswith(".params")


def _peer_key(stats: TensorStats) -> tuple[str, int]:
    # Peers share the last name component and rank: every `.weight` matrix, every Adam
    # `exp_avg_sq` vector. Indices in the name (layers.3) do not matter.
    return stats.name.rsplit(".", 1)[-1], len(stats.shape)


def _outliers(tensors: list[TensorStats]) -> list[AuditFinding]:
    groups: dict[tuple[str, int], list[TensorStats]] = defaultdict(list)
    for t in tensors:
        if t.numel > 1 and t.rms and t.absmax and not t.dtype.startswith(("int", "uint", "bool")):
            groups[_peer_key(t)].append(t)
    findings = []
    for (suffix, _), peers in groups.items():
        if len(peers) < MIN_PEERS:
            continue
        flagged: set[str] = set()
        for metric in ("rms", "absmax"):
            logs = np.log10([getattr(p, metric) for p in peers])
            med = float(np.median(logs))
            for p, lg, zi in zip(peers, logs, robust_z(logs), strict=True):
                if p.name in flagged or abs(lg - med) < OUTLIER_DECADES or abs(zi) < OUTLIER_Z:
                    continue
                flagged.add(p.name)
                ratio = float(10 ** (lg - med))
                findings.append(
                    AuditFinding(
                        code="magnitude_outlier",
                        severity="warning",
                        location=p.name,
                        message=f"{p.name}: {metric} {getattr(p, metric):.3g} is {ratio:.3g}x "
                        f"the median of its {len(peers)} '{suffix}' peers",
                        fix="check how this tensor was initialised, loaded or updated",
                        details={"metric": metric, "value": getattr(p, metric), "ratio": ratio},
                    )
                )
    return findings


def _tensor_findings(t: TensorStats) -> list[AuditFinding]:
    out = []
    optim = _is_optimizer_state(t.name)
    if t.nonfinite:
        out.append(
            AuditFinding(
                code="optimizer_state_nonfinite" if optim else "nonfinite",
                severity="error",
                location=t.name,
                message=f"{t.name}: {t.nonfinite} of {t.numel} values non-finite "
                f"(nan {t.nan}, +inf {t.posinf}, -inf {t.neginf})",
                fix="resume from an earlier checkpoint; find the step that produced it "
                "with nanguard.Guard",
                details={"nan": t.nan, "posinf": t.posinf, "neginf": t.neginf},
            )
        )
    suffix = t.name.rsplit(".", 1)[-1]
    if optim and suffix in _SECOND_MOMENTS and t.negative:
        out.append(
            AuditFinding(
                code="optimizer_state_negative",
                severity="error",
                location=t.name,
                message=f"{t.name}: {t.negative} negative values in a second-moment estimate "
                "(must be >= 0; Adam takes its square root)",
                fix="the optimizer state is corrupt: reset it or resume from an earlier checkpoint",
                details={"negative": t.negative},
            )
        )
    if optim and suffix == "step" and t.negative:
        out.append(
            AuditFinding(
                code="optimizer_state_step",
                severity="error",
                location=t.name,
                message=f"{t.name}: negative step count",
                fix="reset the optimizer state",
            )
        )
    return out


def _scalar_findings(scalars: dict[str, Any]) -> list[AuditFinding]:
    out = []
    for name, value in scalars.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        suffix = name.rsplit(".", 1)[-1]
        if not math.isfinite(value):
            code = "optimizer_state_nonfinite" if ".param_groups." in name else "nonfinite"
            out.append(
                AuditFinding(
                    code=code,
                    severity="error",
                    location=name,
                    message=f"{name} = {value}",
                    fix="set it to a finite value",
                )
            )
        elif ".param_groups." in name and suffix in ("lr", "eps") and value < 0:
            out.append(
                AuditFinding(
                    code="optimizer_hyperparameter",
                    severity="error",
                    location=name,
                    message=f"{name} = {value} is negative",
                    fix="use a value > 0",
                )
            )
        elif ".param_groups." in name and suffix == "eps" and value == 0:
            out.append(
                AuditFinding(
                    code="optimizer_hyperparameter",
                    severity="warning",
                    location=name,
                    message=f"{name} = 0: Adam divides by sqrt(v)+eps",
                    fix="use eps=1e-8 (the default)",
                )
            )
        elif suffix == "scale" and "scaler" in name and value <= 0:
            out.append(
                AuditFinding(
                    code="loss_scale",
                    severity="error",
                    location=name,
                    message=f"{name} = {value}: AMP loss scale must be > 0",
                    fix="reset the GradScaler",
                )
            )
    return out


def _audit_source(source: Source, path: str) -> CheckpointReport:
    report = CheckpointReport(path=path, format=source.format)
    names = source.names()
    total = sum(source.nbytes(n) for n in names)
    with progress(total, f"audit {os.path.basename(path)}") as bar:
        for name in names:
            stats = tensor_stats(source, name, bar)
            report.tensors.append(stats)
            report.findings.extend(_tensor_findings(stats))
    report.findings.extend(_scalar_findings(source.scalars()))
    report.findings.extend(_outliers(report.tensors))
    return report


def _check_manifest(report: CheckpointReport, source: Source, manifest: str | None) -> None:
    """Compare the audit's hashes with the checkpoint's manifest (no tensor is read again)."""
    try:
        found = load_manifest_for(report.path, manifest)
    except AuditInputError as exc:
        if manifest:  # the user named it: a bad argument
            raise
        # Found beside the file but unreadable (perhaps hit by the same fault): the audit of
        # the tensors still stands, and the manifest is reported, not silently skipped.
        report.findings.append(
            AuditFinding(
                code="manifest_unreadable",
                severity="error",
                location=report.path,
                message=str(exc),
                fix="re-create it with nanguard.audit.write_manifest from a copy you trust, "
                "or delete it",
            )
        )
        return
    if found is None:
        return
    where, expected = found
    check = ManifestCheck(manifest=where)
    tensors = {t.name: {"dtype": t.dtype, "shape": t.shape, "sha256": t.sha256}
               for t in report.tensors}
    check.compare(os.path.basename(report.path), expected,
                  {"tensors": tensors, "scalars": scalar_entries(source)})
    report.manifest = check
    report.findings.extend(check.findings())


def audit_checkpoint(
    path: str | os.PathLike[str], *, manifest: str | os.PathLike[str] | None = None
) -> CheckpointReport:
    """Audit one checkpoint (safetensors or torch; a state dict or nested dicts).

    When the checkpoint has a manifest (`nanguard.audit.manifest`: ``CKPT.nanguard-manifest.json``
    or ``nanguard-manifest.json`` in its folder), every tensor is also compared with it, from
    the hashes the audit computes anyway: each one that changed since the save is a
    `manifest_mismatch` error.

    Args:
        path: The checkpoint file. Its format is read from its content, not its extension.
        manifest: The manifest to verify against, instead of the one found beside the file.

    Returns:
        Per-tensor statistics and the findings; `report.ok` is False when any finding is an
        error or a warning.

    Raises:
        AuditInputError: the file is missing, corrupt or not a checkpoint; an explicit
            `manifest` is missing, unreadable or does not list the file.
        UnsafeCheckpointError: loading it would execute pickled code; it is not loaded.
    """
    with open_checkpoint(os.fspath(path)) as source:
        report = _audit_source(source, os.fspath(path))
        _check_manifest(report, source, os.fspath(manifest) if manifest else None)
        return report


def _diff_tensor(sa: Source, sb: Source, name: str) -> tuple[float, float]:
    """(max |b - a|, ||b - a|| / ||a||) over positions finite in both."""
    import torch

    maxdiff, dsq, asq = 0.0, 0.0, 0.0
    for ca, cb in zip(sa.chunks(name), sb.chunks(name), strict=True):
        a, b = _as_float64(ca), _as_float64(cb)
        both = torch.isfinite(a) & torch.isfinite(b)
        d = (b - a)[both]
        if d.numel():
            maxdiff = max(maxdiff, float(d.abs().max()))
            dsq += float((d * d).sum())
            asq += float((a[both] ** 2).sum())
    rel = math.sqrt(dsq / asq) if asq > 0 else (0.0 if dsq == 0 else math.inf)
    return maxdiff, rel


def diff_checkpoints(path_a: str | os.PathLike[str], path_b: str | os.PathLike[str]) -> DiffReport:
    """Audit two checkpoints and say which tensors changed between them, by how much, and
    which became non-finite. `a` is the older one.

    Raises:
        AuditInputError: either file is missing, corrupt or not a checkpoint.
    """
    pa, pb = os.fspath(path_a), os.fspath(path_b)
    with open_checkpoint(pa) as sa, open_checkpoint(pb) as sb:
        ra, rb = _audit_source(sa, pa), _audit_source(sb, pb)
        report = DiffReport(a=ra, b=rb)
        stats_a = {t.name: t for t in ra.tensors}
        stats_b = {t.name: t for t in rb.tensors}
        for name in [n for n in stats_a if n not in stats_b]:
            report.changes.append(TensorChange(name=name, status="removed"))
        for name, tb in stats_b.items():
            ta = stats_a.get(name)
            if ta is None:
                report.changes.append(TensorChange(name=name, status="added"))
            elif ta.sha256 == tb.sha256:
                report.unchanged += 1
            elif ta.shape != tb.shape or ta.dtype != tb.dtype:
                report.changes.append(TensorChange(name=name, status="reshaped"))
            else:
                maxdiff, rel = _diff_tensor(sa, sb, name)
                change = TensorChange(
                    name=name,
                    status="changed",
                    max_abs_diff=maxdiff,
                    rel_change=rel,
                    became_nonfinite=tb.nonfinite > 0 and ta.nonfinite == 0,
                )
                report.changes.append(change)
                if change.became_nonfinite:
                    report.findings.append(
                        AuditFinding(
                            code="became_nonfinite",
                            severity="error",
                            location=name,
                            message=f"{name}: finite in {pa}, {tb.nonfinite} non-finite in {pb}",
                            fix=f"the update between them broke it; resume from {pa}",
                        )
                    )
    return report
