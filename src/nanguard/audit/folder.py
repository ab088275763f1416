"""Audit and scan a folder: a sharded checkpoint or a data set split into shards.

A Hugging Face `checkpoint-N/` folder holds the weights in several files
(`model-00001-of-00003.safetensors`, or `pytorch_model-00001-of-00003.bin`) named by an index
(`model.safetensors.index.json`, `pytorch_model.bin.index.json`), next to the optimizer state
(`optimizer.pt`) and files that are no tensor checkpoint at all (`training_args.bin`, a pickle
of the Trainer's arguments; `rng_state.pth`, RNG states as NumPy objects). A data set is often
a folder of Parquet or CSV shards. `audit_folder` and `scan_folder` look at every file of a
known kind under the folder (subfolders included, in name order), report each one as the
single-file auditors do, and add what only the folder shows: shards the index names that are
missing, tensors the index puts in a shard that lacks them, and files that could not be read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from nanguard.audit.common import AuditFinding, AuditInputError, UnsafeCheckpointError, one_line

CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")
DATA_SUFFIXES = (".csv", ".tsv", ".parquet", ".pq", ".npy", ".npz", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"

# Files a Hugging Face Trainer writes into checkpoint-N/ that hold no model or optimizer
# tensors, only pickled Python objects: listed as skipped, not flagged as unsafe.
NOT_CHECKPOINTS = {
    "training_args.bin": "the Trainer's arguments (a pickle, not tensors)",
}
NOT_CHECKPOINT_PREFIXES = {
    "rng_state": "RNG states (NumPy and Python objects, not tensors)",
}

R = TypeVar("R")


@dataclass(kw_only=True)
class FolderReport(Generic[R]):
    """One report per file of the folder, the files left out, and the folder's own findings.

    Attributes:
        path: The folder.
        files: Per file, its path relative to the folder and the single-file report.
        skipped: Files not audited, each `{"file", "reason"}`.
        findings: What only the folder shows (a missing shard, an unreadable file).
    """

    path: str
    files: list[tuple[str, R]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    findings: list[AuditFinding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        own = not any(f.severity in ("error", "warning") for f in self.findings)
        return own and all(getattr(r, "ok", True) for _, r in self.files)

    def all_findings(self) -> list[tuple[str, AuditFinding]]:
        """Every finding with the file it is about ("" for the folder's own)."""
        out = [(name, f) for name, r in self.files for f in getattr(r, "findings", [])]
        return out + [(f.location, f) for f in self.findings]

    def total(self) -> dict[str, Any]:
        """Counts over the whole folder (what the CLI prints as its last line)."""
        found = [f for _, f in self.all_findings()]
        total: dict[str, Any] = {
            "files": len(self.files),
            "skipped": len(self.skipped),
            "errors": sum(f.severity == "error" for f in found),
            "warnings": sum(f.severity == "warning" for f in found),
        }
        tensors = [t for _, r in self.files for t in getattr(r, "tensors", [])]
        if tensors:
            total["tensors"] = len(tensors)
            total["nonfinite_tensors"] = sum(1 for t in tensors if t.nonfinite)
            total["nonfinite_values"] = sum(t.nonfinite for t in tensors)
        tables = [t for _, r in self.files for t in getattr(r, "tables", [])]
        if tables:
            total["tables"] = len(tables)
            total["rows"] = sum(t.rows for t in tables)
            total["nonfinite_cells"] = sum(c.nan + c.posinf + c.neginf
                                           for t in tables for c in t.columns)
        return total

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "ok": self.ok,
            "files": [{"file": name, **r.to_dict()} for name, r in self.files],  # type: ignore[attr-defined]
            "skipped": self.skipped,
            "findings": [f.to_dict() for f in self.findings],
            "total": self.total(),
        }


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Files under `root` with one of `suffixes`, in name order; hidden folders left out."""
    found = [p for p in root.rglob("*")
             if p.is_file() and p.suffix.lower() in suffixes
             and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def _each(root: Path, files: list[Path], report: FolderReport[R], one: Callable[[str], R],
          skip: Callable[[Path], str | None]) -> None:
    """Run the single-file auditor `one` on each file; a file it cannot read becomes a
    finding of the folder (an error: the folder is not what it should be), not an abort.
    Over `PROGRESS_BYTES` in all, a progress bar says how far it got (stderr, a terminal)."""
    size = sum(p.stat().st_size for p in files)
    if size < PROGRESS_BYTES or len(files) < 2:
        _each_file(root, files, report, one, skip, lambda: None)
        return
    from nanguard.show.progress import waiting

    with waiting(f"reading {len(files)} files ({size / 2**30:.1f} GiB) under {root}",
                 total=len(files), unit="files") as tick:
        _each_file(root, files, report, one, skip, tick)


PROGRESS_BYTES = 512 * 2**20
"""A folder this large takes seconds to read and hash: show progress (a wait over ~2 s)."""


def _each_file(root: Path, files: list[Path], report: FolderReport[R],
               one: Callable[[str], R], skip: Callable[[Path], str | None],
               tick: Callable[[], None]) -> None:
    for path in files:
        tick()
        rel = str(path.relative_to(root))
        reason = skip(path)
        if reason is not None:
            report.skipped.append({"file": rel, "reason": reason})
            continue
        try:
            report.files.append((rel, one(str(path))))
        except UnsafeCheckpointError as exc:
            report.findings.append(AuditFinding(
                code="unsafe", severity="error", location=rel, message=str(exc),
                fix="load it only if you trust its origin; never with weights_only=False "
                "otherwise"))
        except AuditInputError as exc:
            report.findings.append(AuditFinding(
                code="unreadable", severity="error", location=rel, message=str(exc)))


def _checkpoint_skip(path: Path) -> str | None:
    if path.name in NOT_CHECKPOINTS:
        return NOT_CHECKPOINTS[path.name]
    for prefix, reason in NOT_CHECKPOINT_PREFIXES.items():
        if path.name.startswith(prefix):
            return reason
    return None


def _index_findings(root: Path, report: FolderReport[Any]) -> None:
    """Check each shard index (`*.index.json`, `weight_map`: tensor name -> shard file)
    against the shards: every shard present, every tensor in the shard the index names."""
    audited = {name: r for name, r in report.files}
    for index in sorted(root.rglob(f"*{INDEX_SUFFIX}")):
        rel = str(index.relative_to(root))
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError) as exc:
            report.findings.append(AuditFinding(code="bad_index", severity="error", location=rel,
                                           message=f"unreadable shard index: {one_line(exc)}"))
            continue
        if not isinstance(weight_map, dict):
            report.findings.append(AuditFinding(code="bad_index", severity="error", location=rel,
                                           message="the shard index has no weight_map"))
            continue
        by_shard: dict[str, list[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(str(tensor))
        for shard, tensors in sorted(by_shard.items()):
            shard_rel = str((index.parent / shard).relative_to(root))
            if not (index.parent / shard).is_file():
                report.findings.append(AuditFinding(
                    code="missing_shard", severity="error", location=shard_rel,
                    message=f"{rel} names the shard {shard} ({len(tensors)} tensors), which "
                    "is not in the folder",
                    fix="copy the missing shard, or save the checkpoint again"))
                continue
            if shard_rel not in audited:
                continue  # unreadable: already a finding
            held = {t.name for t in getattr(audited[shard_rel], "tensors", [])}
            absent = [t for t in tensors if t not in held]
            if absent:
                report.findings.append(AuditFinding(
                    code="missing_tensor", severity="error", location=shard_rel,
                    message=f"{rel} puts {len(absent)} tensor(s) in {shard} that it does not "
                    f"hold: {', '.join(absent[:5])}{'...' if len(absent) > 5 else ''}",
                    details={"tensors": absent[:50]}))


def audit_folder(path: str | os.PathLike[str]) -> FolderReport[Any]:
    """Audit every checkpoint file under a folder (a sharded checkpoint, `checkpoint-N/`).

    Raises:
        AuditInputError: the folder holds no checkpoint file.
    """
    from nanguard.audit.checkpoint import audit_checkpoint

    root = Path(path)
    report: FolderReport[Any] = FolderReport(path=os.fspath(path))
    files = _files(root, CHECKPOINT_SUFFIXES)
    if not files:
        raise AuditInputError(f"{path}: no checkpoint files in this folder (looked for "
                              f"{', '.join(CHECKPOINT_SUFFIXES)})")
    _each(root, files, report, audit_checkpoint, _checkpoint_skip)
    _index_findings(root, report)
    _folder_manifest_findings(root, report)
    return report


def _folder_manifest_findings(root: Path, report: FolderReport[Any]) -> None:
    """With a folder manifest (`write_manifest(folder)`): the files it lists that are missing,
    and those it hashed as bytes (unsafe to load: a Trainer's `rng_state.pth`) whose bytes
    changed. Tensor files are verified tensor by tensor by `audit_checkpoint` itself."""
    from nanguard.audit.manifest import FOLDER_MANIFEST, ManifestCheck, file_entries

    where = root / FOLDER_MANIFEST
    if not where.is_file():
        return
    try:
        listed = json.loads(where.read_text()).get("files") or {}
    except (OSError, ValueError, AttributeError) as exc:
        report.findings.append(AuditFinding(code="manifest_unreadable", severity="error",
                                       location=str(where), message=one_line(exc)))
        return
    check = ManifestCheck(manifest=str(where))
    for name, expected in sorted(listed.items()):
        path = root / name
        if not path.is_file():
            check.compare(name, expected, None)
        elif isinstance(expected, dict) and "file_sha256" in expected:
            check.compare(name, expected, file_entries(str(path)))
    report.findings.extend(check.findings())


def scan_folder(path: str | os.PathLike[str], config: Any = None) -> FolderReport[Any]:
    """Scan every data file under a folder (a data set split into shards); `config` is the
    `ScanConfig` every file is scanned with.

    Raises:
        AuditInputError: the folder holds no data file.
    """
    from nanguard.audit.scan import scan_file

    root = Path(path)
    report: FolderReport[Any] = FolderReport(path=os.fspath(path))
    files = _files(root, DATA_SUFFIXES)
    if not files:
        raise AuditInputError(f"{path}: no data files in this folder (looked for "
                              f"{', '.join(DATA_SUFFIXES)})")
    _each(root, files, report, lambda p: scan_file(p, config), lambda _: None)
    return report
