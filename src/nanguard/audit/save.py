"""`nanguard.save(obj, path)`: save a checkpoint and its manifest, never one without the other
half-written.

The manifest is hashed from the object in memory (what was meant to be written), so a later
`nanguard audit PATH` names every tensor whose bytes changed on the way to disk or after.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

from nanguard.audit.manifest import MANIFEST_SUFFIX, build_manifest, dump_manifest, hash_object


def _fsync_dir(folder: str) -> None:
    # The renames are durable only once the directory entry is: best effort (not on Windows).
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_checkpoint(obj: Any, tmp: str, safetensors: bool) -> None:
    if safetensors:
        from safetensors.torch import save_file

        if not isinstance(obj, dict) or not all(hasattr(v, "dtype") for v in obj.values()):
            raise ValueError("nanguard.save: a .safetensors file holds a flat dict of tensors")
        try:
            save_file(obj, tmp)
        except RuntimeError as exc:
            if "share memory" not in str(exc):
                raise
            # Tied weights (an embedding shared with the output layer): safetensors refuses
            # them; say so in one line instead of its multi-line error.
            raise ValueError(
                "nanguard.save: tensors share memory (tied weights), which a .safetensors file "
                "cannot hold; save to a torch file (.pt) or clone the tied ones"
            ) from None
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        return
    import torch

    # Through a file object: torch names the archive's root folder after a path's basename,
    # and the temporary name should not end up inside the checkpoint.
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save(obj: Any, path: str | os.PathLike[str]) -> str:
    """Save `obj` with `torch.save` (or safetensors, for a path ending in ``.safetensors``)
    and write its manifest, ``PATH.nanguard-manifest.json``.

    Runs when called, on the calling thread: hashes every tensor once (sha256, from memory),
    writes both files to temporary names in the target folder, fsyncs them, then renames them
    into place. Guarantees: a crash at any point leaves either the previous checkpoint with its
    previous manifest, or the new checkpoint with no manifest or its own one; never a
    manifest beside a checkpoint it does not describe (the old manifest is removed before the
    new checkpoint takes its name).

    Args:
        obj: A state dict or nested dicts/lists of tensors and plain values (what
            `torch.load(weights_only=True)` reads back); for safetensors a flat dict of tensors.
        path: The checkpoint file.

    Returns:
        The manifest's path.

    Raises:
        ValueError: `obj` holds no tensor (e.g. a module: save its `state_dict()`), or is not
            a flat dict of tensors for a ``.safetensors`` path, or holds tied tensors there.
    """
    path = os.fspath(path)
    hashed = hash_object(obj, "nanguard.save", "save")
    folder = os.path.dirname(os.path.abspath(path))
    base = os.path.basename(path)
    manifest = path + MANIFEST_SUFFIX
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{base}.", suffix=".tmp")
    os.close(fd)
    tmp_manifest = tmp + MANIFEST_SUFFIX
    try:
        _write_checkpoint(obj, tmp, safetensors=path.endswith(".safetensors"))
        dump_manifest(build_manifest({base: hashed}), tmp_manifest)
        with contextlib.suppress(FileNotFoundError):
            os.remove(manifest)
        os.replace(tmp, path)
        os.replace(tmp_manifest, manifest)
    finally:
        for leftover in (tmp, tmp_manifest):
            with contextlib.suppress(FileNotFoundError):
                os.remove(leftover)
    _fsync_dir(folder)
    return manifest
