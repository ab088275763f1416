"""Offline auditors: checkpoints (`audit`), data sets (`scan`), training code (`lint`) and a
model before training (`preflight`). They share no state with a running Guard.

Heavy and optional dependencies (torch, pyarrow, safetensors) are imported inside the
functions that need them.

The public names are imported on first use (PEP 562), not here: every `nanguard` command
imports a part of this package (the parser's helpers, `nanguard run` the live preflight), and
none needs every auditor (the checkpoint auditor with numpy, the lint rules, the scanners).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
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

# `preflight` is also a submodule's name: importing that submodule (as the live preflight
# does) sets this package's attribute to the module, so the function is bound here, at once,
# to stay what `from nanguard.audit import preflight` gives (the module is light: stdlib only).
from nanguard.audit.preflight import preflight  # noqa: E402
from nanguard.lazy import lazy_names  # noqa: E402

# Public name -> the module that defines it (the rest).
_LAZY: dict[str, str] = {
    "CheckpointReport": "nanguard.audit.checkpoint",
    "DiffReport": "nanguard.audit.checkpoint",
    "TensorChange": "nanguard.audit.checkpoint",
    "TensorStats": "nanguard.audit.checkpoint",
    "audit_checkpoint": "nanguard.audit.checkpoint",
    "diff_checkpoints": "nanguard.audit.checkpoint",
    "AuditFinding": "nanguard.audit.common",
    "AuditInputError": "nanguard.audit.common",
    "UnsafeCheckpointError": "nanguard.audit.common",
    "LintFinding": "nanguard.audit.lint",
    "RULES": "nanguard.audit.lint",
    "lint_paths": "nanguard.audit.lint",
    "lint_source": "nanguard.audit.lint",
    "ManifestCheck": "nanguard.audit.manifest",
    "verify_manifest": "nanguard.audit.manifest",
    "write_manifest": "nanguard.audit.manifest",
    "LRProbeResult": "nanguard.audit.preflight",
    "LayerInit": "nanguard.audit.preflight",
    "OverfitResult": "nanguard.audit.preflight",
    "PreflightConfig": "nanguard.audit.preflight",
    "PreflightReport": "nanguard.audit.preflight",
    "ColumnStats": "nanguard.audit.scan",
    "ScanConfig": "nanguard.audit.scan",
    "ScanReport": "nanguard.audit.scan",
    "scan_dataset": "nanguard.audit.scan",
    "scan_file": "nanguard.audit.scan",
}

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


__getattr__, __dir__ = lazy_names("nanguard.audit", _LAZY, globals(), __all__)
