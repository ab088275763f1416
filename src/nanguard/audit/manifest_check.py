"""Comparing a checkpoint with its manifest: where the manifest is, and what differs.

Pure bookkeeping over hashes already computed (by `manifest.hash_source` or by the audit's
`TensorStats`), so `nanguard audit` verifies a manifest without reading any tensor twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from nanguard.audit.common import AuditFinding, FieldsToDict

SCHEMA = 1
MANIFEST_SUFFIX = ".nanguard-manifest.json"
FOLDER_MANIFEST = "nanguard-manifest.json"

_FIX = (
    "the checkpoint changed after it was saved (storage, copy or memory corruption, or an "
    "edit): restore it from another copy, or re-save it from a healthy run"
)


@dataclass(kw_only=True)
class ManifestMismatch(FieldsToDict):
    """One difference between a checkpoint and its manifest.

    `status` is ``changed`` (same dtype and shape, other bytes), ``dtype``, ``shape``,
    ``missing`` (in the manifest, not in the file), ``extra`` (in the file, not in the
    manifest), ``missing_file`` or ``extra_file`` (a shard of a folder). `kind` is ``tensor``,
    ``scalar`` or ``file``.
    """

    file: str
    name: str
    status: str
    kind: str = "tensor"
    expected: Any = None
    found: Any = None

    def message(self) -> str:
        exp, got = self.expected, self.found
        where = f"{self.name}" if self.kind != "file" else self.file
        if self.status == "changed" and self.kind in ("tensor", "file"):
            return (f"{where}: bytes differ from the manifest (sha256 {str(got)[:12]}, saved "
                    f"{str(exp)[:12]})")
        if self.status in ("changed", "dtype", "shape"):
            what = "value" if self.status == "changed" else self.status
            return f"{where}: {what} {got!r}, the manifest says {exp!r}"
        if self.status == "missing":
            return f"{where}: in the manifest, missing from {self.file}"
        if self.status == "extra":
            return f"{where}: in {self.file}, not in the manifest"
        if self.status == "missing_file":
            return f"{where}: shard listed in the manifest is missing"
        return f"{where}: shard not listed in the manifest"


@dataclass(kw_only=True)
class ManifestCheck:
    """The result of comparing a checkpoint with its manifest. `ok` when nothing differs."""

    manifest: str
    checked: int = 0
    """Tensors compared (present in both the manifest and the checkpoint)."""
    mismatches: list[ManifestMismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def compare(
        self, file: str, expected: dict[str, Any] | None, found: dict[str, Any] | None
    ) -> None:
        """Compare one file's entries (`manifest.hash_source` layout; None when the file is
        absent from the manifest or from the disk)."""
        if expected is None or found is None:
            status = "extra_file" if expected is None else "missing_file"
            self.mismatches.append(
                ManifestMismatch(file=file, name=file, status=status, kind="file")
            )
            return
        if "file_sha256" in expected or "file_sha256" in found:
            # A file hashed as bytes (unsafe to load): the whole file is the unit compared.
            if expected.get("file_sha256") != found.get("file_sha256"):
                self._add(file, file, "changed", kind="file",
                          expected=expected.get("file_sha256"), found=found.get("file_sha256"))
            else:
                self.checked += 1
            return
        want, have = expected.get("tensors", {}), found.get("tensors", {})
        for name, e in want.items():
            h = have.get(name)
            if h is None:
                self._add(file, name, "missing")
                continue
            self.checked += 1
            for key, status in (("dtype", "dtype"), ("shape", "shape"), ("sha256", "changed")):
                if list_or(e.get(key)) != list_or(h.get(key)):
                    self._add(file, name, status, expected=e.get(key), found=h.get(key))
                    break
        for name in have:
            if name not in want:
                self._add(file, name, "extra")
        want_s, have_s = expected.get("scalars", {}), found.get("scalars", {})
        for name in sorted(set(want_s) | set(have_s)):
            if name not in have_s:
                self._add(file, name, "missing", kind="scalar")
            elif name not in want_s:
                self._add(file, name, "extra", kind="scalar")
            elif want_s[name] != have_s[name]:
                self._add(
                    file, name, "changed", kind="scalar", expected=want_s[name], found=have_s[name]
                )

    def _add(self, file: str, name: str, status: str, **kw: Any) -> None:
        self.mismatches.append(ManifestMismatch(file=file, name=name, status=status, **kw))

    def findings(self) -> list[AuditFinding]:
        """One `manifest_mismatch` error per mismatch, located at the tensor (or shard)."""
        return [
            AuditFinding(
                code="manifest_mismatch",
                severity="error",
                location=m.name,
                message=m.message(),
                fix=_FIX,
                details={
                    "status": m.status,
                    "kind": m.kind,
                    "file": m.file,
                    "expected": m.expected,
                    "found": m.found,
                },
            )
            for m in self.mismatches
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "ok": self.ok,
            "checked": self.checked,
            "mismatches": [m.to_dict() for m in self.mismatches],
        }


def why_changed(checkpoint: str, manifest: str) -> str:
    """What most likely changed the checkpoint, for a message: written again after its
    manifest (a plain `torch.save` over a file `nanguard.save` had written leaves the old
    manifest beside it) when the file is newer than the manifest, else corruption after the
    save (storage, a copy, memory: none of them touches the file's modification time)."""
    try:
        newer = os.path.getmtime(checkpoint) > os.path.getmtime(manifest) + 1.0
    except OSError:
        newer = False
    if newer:
        return ("the file was written after its manifest: saved again without nanguard.save "
                "(the old manifest no longer describes it), or changed since")
    return "the checkpoint changed after it was saved (storage, copy or memory corruption)"


def list_or(value: Any) -> Any:
    """Shapes read back from JSON are lists; compare tuples and lists alike."""
    return list(value) if isinstance(value, tuple) else value


def find_manifest(checkpoint: str) -> str | None:
    """The manifest that belongs to a checkpoint, or None.

    A file's is ``CKPT.nanguard-manifest.json``, else ``nanguard-manifest.json`` in its folder
    (a folder of shards); a folder's is ``FOLDER/nanguard-manifest.json``.
    """
    if os.path.isdir(checkpoint):
        candidates = [os.path.join(checkpoint, FOLDER_MANIFEST)]
    else:
        folder = os.path.dirname(os.path.abspath(checkpoint))
        candidates = [checkpoint + MANIFEST_SUFFIX, os.path.join(folder, FOLDER_MANIFEST)]
    return next((c for c in candidates if os.path.isfile(c)), None)


def entries_for(manifest: str, listed: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The manifest entries of the checkpoint file `name`, or None if it lists none.

    A per-file manifest (``X.nanguard-manifest.json``) lists one file; its entries apply
    whatever the checkpoint is called now (renamed together with its manifest). A folder
    manifest's apply only to the file of that name.
    """
    if name in listed:
        return dict(listed[name])
    if os.path.basename(manifest) != FOLDER_MANIFEST and len(listed) == 1:
        return dict(next(iter(listed.values())))
    return None
