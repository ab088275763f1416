"""`nanguard.load(path)`: load a checkpoint without executing pickled code, and verify it
against the manifest written when it was saved (`nanguard.save`, `write_manifest`).

The tensors are hashed from what was loaded, in memory (the same per-tensor sha256 as the
manifest: `manifest.HASH_DEFINITION`), so the file is read once. A checkpoint whose bytes
changed after the save (storage, a copy, memory) would otherwise load without error and train
on silently wrong weights; here it is refused, naming every tensor that changed.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from nanguard.audit.ckpt_load import TorchSource
from nanguard.audit.common import one_line
from nanguard.audit.manifest import hash_source, load_manifest_for
from nanguard.audit.manifest_check import ManifestCheck, why_changed

__all__ = ["CheckpointMismatch", "load", "verify_loaded"]

_SHOWN = 3  # mismatches named in the one-line message (all of them are in `.check`)


class CheckpointMismatch(ValueError):
    """A checkpoint differs from its manifest. `check` holds every difference (tensor,
    status, expected and found hashes); the message is one line naming the first few."""

    def __init__(self, path: str, check: ManifestCheck) -> None:
        self.path = path
        self.check = check
        shown = "; ".join(m.message() for m in check.mismatches[:_SHOWN])
        more = len(check.mismatches) - _SHOWN
        super().__init__(
            f"{path}: {len(check.mismatches)} difference(s) from its manifest "
            f"{check.manifest}: {shown}" + (f"; and {more} more" if more > 0 else "")
            + f"; {why_changed(path, check.manifest)}: restore the checkpoint from another "
            "copy or re-save it from a healthy run (`nanguard audit` lists every difference)")


def verify_loaded(obj: Any, path: str, manifest: str | None = None) -> ManifestCheck | None:
    """Compare an object loaded from `path` with the manifest of `path`.

    Runs when called; hashes every tensor of `obj` once (sha256, from memory).

    Args:
        obj: what `torch.load` / safetensors' `load_file` returned for `path`.
        path: the checkpoint file it was loaded from.
        manifest: the manifest; default: the one beside `path`, if any.

    Returns:
        The comparison, or None when `path` has no manifest (nothing to verify against).

    Raises:
        AuditInputError: an explicit `manifest` that is missing, unreadable or does not list
            the file.
    """
    found = load_manifest_for(path, manifest)
    if found is None:
        return None
    where, entries = found
    check = ManifestCheck(manifest=where)
    check.compare(os.path.basename(path), entries, hash_source(TorchSource(obj)))
    return check


def load(path: str | os.PathLike[str], *, map_location: Any = "cpu",
         manifest: str | os.PathLike[str] | None = None, verify: bool = True) -> Any:
    """Load a checkpoint file and verify it against its manifest before handing it over.

    A torch file is read with `torch.load(weights_only=True)` (tensors, containers and plain
    values; no pickled code runs), a ``.safetensors`` file with safetensors. Runs when called,
    on the calling thread; verifying costs one sha256 pass over the loaded tensors.

    Args:
        path: the checkpoint file.
        map_location: where tensors are loaded (as `torch.load`'s; a device for safetensors).
        manifest: the manifest to verify against; default ``PATH.nanguard-manifest.json`` (or
            the folder's ``nanguard-manifest.json``) when there is one. A file without any
            manifest loads unverified.
        verify: False skips the verification.

    Returns:
        What was saved (for safetensors: the dict of tensors).

    Raises:
        CheckpointMismatch: a tensor's bytes, dtype or shape, a scalar, or the set of names
            differs from the manifest (a ValueError: one line naming the first differences).
        ValueError: no such file, or a file that is not a loadable checkpoint (or one that
            would need to execute pickled code).
    """
    file = os.fspath(path)
    if not os.path.isfile(file):
        raise ValueError(f"nanguard.load: no such checkpoint file: {file!r}")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            obj: Any = load_file(file, device=str(map_location))
        else:
            import torch

            obj = torch.load(file, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as exc:
        raise ValueError(f"nanguard.load: cannot load {file!r} safely "
                         f"({one_line(exc)[:200]})") from None
    if verify:
        check = verify_loaded(obj, file, None if manifest is None else os.fspath(manifest))
        if check is not None and not check.ok:
            raise CheckpointMismatch(file, check)
    return obj
