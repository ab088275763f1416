"""Offline auditors: checkpoints (`audit`), data sets (`scan`), training code (`lint`) and a
model before training (`preflight`). They share no state with a running Guard.

Heavy and optional dependencies (torch, pyarrow, safetensors) are imported inside the
functions that need them.
"""

from nanguard.audit.checkpoint import (
    CheckpointReport,
    DiffReport,
    TensorChange,
    TensorStats,
    audit_checkpoint,
    diff_checkpoints,
)
from nanguard.audit.common import AuditFinding, AuditInputError, UnsafeCheckpointError
from nanguard.audit.lint import RULES, LintFinding, lint_paths, lint_source
from nanguard.audit.manifest import ManifestCheck, verify_manifest, write_manifest
from nanguard.audit.preflight import (
    LayerInit,
    LRProbeResult,
    OverfitResult,
    PreflightConfig,
    PreflightReport,
    preflight,
)
from nanguard.audit.scan import ColumnStats, ScanConfig, ScanReport, scan_dataset, scan_file

__all__ = [
    "RULES",
    "AuditInputError",
    "CheckpointReport",
    "ColumnStats",
    "DiffReport",
    "AuditFinding",
    "LRProbeResult",
    "LayerInit",
    "LintFinding",
    "ManifestCheck",
    "OverfitResult",
    "PreflightConfig",
    "PreflightReport",
    "ScanConfig",
    "ScanReport",
    "TensorChange",
    "TensorStats",
    "UnsafeCheckpointError",
    "audit_checkpoint",
    "diff_checkpoints",
    "lint_paths",
    "lint_source",
    "preflight",
    "scan_dataset",
    "scan_file",
    "verify_manifest",
    "write_manifest",
]
