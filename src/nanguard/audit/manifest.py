"""Checkpoint manifests: per-tensor content hashes written beside a checkpoint, verified later.

A bit that flips on disk, in a copy or in host memory after the save leaves a checkpoint that
loads without error and trains on silently wrong weights. The manifest records, per tensor, its
dtype, shape and the sha256 of its bytes (`ckpt_load.new_digest`: format- and device-independent,
the same hash `nanguard audit` lists), so that `nanguard audit CKPT` can name every tensor that
changed since the save. Non-tensor leaves (step counters, learning rates) are recorded by value.

Where the manifest lives: ``CKPT.nanguard-manifest.json`` beside a checkpoint file, or
``nanguard-manifest.json`` inside a folder of shards (one entry list per shard file).
Cost: hashing streams each tensor once, at sha256 speed (see BENCHMARKS.md); nothing here
executes pickled code (checkpoints are opened through `ckpt_load`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from typing import Any

from nanguard.audit.ckpt_load import Source, TorchSource, new_digest, open_checkpoint, sniff
from nanguard.audit.ckpt_load import update_digest as _update
from nanguard.audit.common import AuditInputError, UnsafeCheckpointError, json_safe, one_line
from nanguard.audit.manifest_check import (
    FOLDER_MANIFEST,
    MANIFEST_SUFFIX,
    SCHEMA,
    ManifestCheck,
    entries_for,
    find_manifest,
)

__all__ = [
    "FOLDER_MANIFEST",
    "MANIFEST_SUFFIX",
    "ManifestCheck",
    "find_manifest",
    "hash_source",
    "verify_manifest",
    "write_manifest",
]

HASH_DEFINITION = "sha256(dtype + str(list(shape)) + row-major little-endian bytes)"


def _scalar(value: Any) -> Any:
    """A non-tensor leaf as JSON stores it (tuples become lists; unknown types their repr)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_scalar(v) for v in value]
    return repr(value)


def hash_source(source: Source) -> dict[str, Any]:
    """Hash every tensor of an opened checkpoint (or an in-memory object wrapped in a
    `TorchSource`). Streams each tensor once.

    Returns:
        ``{"tensors": {name: {"dtype", "shape", "sha256"}}, "scalars": {name: value}}``.
    """
    tensors: dict[str, Any] = {}
    for name in source.names():
        dtype, shape = source.meta(name)
        digest = new_digest(dtype, shape)
        for chunk in source.chunks(name):
            _update(digest, chunk)
        tensors[name] = {"dtype": dtype, "shape": list(shape), "sha256": digest.hexdigest()}
    return {"tensors": tensors, "scalars": scalar_entries(source)}


def hash_object(obj: Any, caller: str, verb: str) -> dict[str, Any]:
    """`hash_source` of an in-memory object (what is saved, or was).

    Raises:
        ValueError: `obj` holds no tensor (a module: its `state_dict()` is what to pass), in
            one line starting with `caller` and saying what to `verb` instead.
    """
    hashed = hash_source(TorchSource(obj))
    if not hashed["tensors"]:
        raise ValueError(
            f"{caller}: {type(obj).__name__} holds no tensor; {verb} a state dict "
            "(model.state_dict(), or a dict of them), not a module"
        )
    return hashed


def scalar_entries(source: Source) -> dict[str, Any]:
    """The checkpoint's non-tensor leaves as the manifest records them."""
    return {k: _scalar(v) for k, v in source.scalars().items()}


def _shard_files(folder: str) -> Iterator[str]:
    """Checkpoint files directly inside `folder` (by content; config and tokenizer files and
    the manifest itself are skipped), sorted."""
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        if name == FOLDER_MANIFEST or name.endswith(MANIFEST_SUFFIX) or not os.path.isfile(full):
            continue
        try:
            sniff(full)
        except AuditInputError:
            continue
        yield name


def _hash_file(path: str) -> dict[str, Any]:
    """Per-tensor hashes of a checkpoint file; for a file that cannot be opened without
    executing pickled code (a Trainer's `rng_state.pth` and `training_args.bin` in a
    checkpoint folder), the sha256 of its bytes (`file_sha256`): still verified, never loaded."""
    try:
        with open_checkpoint(path) as source:
            return hash_source(source)
    except UnsafeCheckpointError:
        return file_entries(path)


def file_entries(path: str) -> dict[str, Any]:
    """A file's manifest entries as bytes: the sha256 of its contents (`file_sha256`)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"tensors": {}, "scalars": {}, "file_sha256": digest.hexdigest()}


def dump_manifest(manifest: dict[str, Any], path: str) -> None:
    """Write the manifest through a temporary file and a rename: a reader never sees half."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(json_safe(manifest), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def build_manifest(files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest document for ``{file name: hash_source(...)}``."""
    return {"nanguard_manifest": SCHEMA, "hash": HASH_DEFINITION, "files": files}


def write_manifest(
    checkpoint: Any,
    path: str | os.PathLike[str] | None = None,
    *,
    manifest: str | os.PathLike[str] | None = None,
) -> str:
    """Write the manifest of a checkpoint: per-tensor sha256, dtype and shape, and its scalars.

    Runs when called (typically right after the save); hashes every tensor once and writes
    the manifest atomically (temporary file + rename).

    Args:
        checkpoint: A checkpoint file (torch or safetensors), a folder of shard files, or the
            object that was saved (a state dict or nested dicts/lists of tensors; then `path`
            must name the file it was saved to). Hashing the object spares re-reading the file
            and records what was meant to be written.
        path: With an object: the checkpoint file it was (or will be) saved to.
        manifest: Where to write the manifest; default ``CKPT.nanguard-manifest.json`` beside
            a file, ``FOLDER/nanguard-manifest.json`` inside a folder.

    Returns:
        The manifest's path.

    Raises:
        ValueError: an object without `path`, an object holding no tensor, or a folder
            without checkpoint files.
        AuditInputError: a checkpoint file that is missing, corrupt or unsafe to load.
    """
    if isinstance(checkpoint, (str, os.PathLike)):
        if path is not None:
            raise ValueError("write_manifest: `path` is only for an object; got a file name twice")
        ckpt = os.fspath(checkpoint)
        if os.path.isdir(ckpt):
            names = list(_shard_files(ckpt))
            if not names:
                raise ValueError(f"{ckpt}: no checkpoint files in this folder")
            files = {n: _hash_file(os.path.join(ckpt, n)) for n in names}
            out = os.fspath(manifest) if manifest else os.path.join(ckpt, FOLDER_MANIFEST)
        else:
            files = {os.path.basename(ckpt): _hash_file(ckpt)}
            out = os.fspath(manifest) if manifest else ckpt + MANIFEST_SUFFIX
    else:
        if path is None:
            raise ValueError("write_manifest(obj, path): name the file the object was saved to")
        ckpt = os.fspath(path)
        files = {os.path.basename(ckpt): hash_object(checkpoint, "write_manifest", "pass")}
        out = os.fspath(manifest) if manifest else ckpt + MANIFEST_SUFFIX
    dump_manifest(build_manifest(files), out)
    return out


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise AuditInputError(f"{path}: no such manifest") from None
    except (OSError, ValueError) as exc:
        raise AuditInputError(f"{path}: unreadable manifest ({one_line(exc)[:160]})") from None
    if not isinstance(data, dict) or data.get("nanguard_manifest") != SCHEMA:
        raise AuditInputError(f"{path}: not a nanguard manifest (schema {SCHEMA})")
    return data


def verify_manifest(
    checkpoint: str | os.PathLike[str], manifest: str | os.PathLike[str] | None = None
) -> ManifestCheck:
    """Re-hash a checkpoint (file or folder of shards) and compare it with its manifest.

    Runs when called; reads every tensor once. Guarantees: every tensor whose bytes, dtype or
    shape differ from the manifest is named, as is every tensor, scalar or shard file that is
    missing or was not there at the save.

    Args:
        checkpoint: The checkpoint file or folder.
        manifest: The manifest; default: found beside it (`find_manifest`).

    Raises:
        AuditInputError: no manifest found, an unreadable manifest, or an unreadable checkpoint.
    """
    ckpt = os.fspath(checkpoint)
    where = os.fspath(manifest) if manifest else find_manifest(ckpt)
    if where is None:
        raise AuditInputError(f"{ckpt}: no manifest found (expected {ckpt}{MANIFEST_SUFFIX})")
    data = _load(where)
    listed: dict[str, Any] = data.get("files", {})
    check = ManifestCheck(manifest=where)
    if os.path.isdir(ckpt):
        for name, expected in listed.items():
            full = os.path.join(ckpt, name)
            found = _hash_file(full) if os.path.exists(full) else None
            check.compare(name, expected, found)
        for name in _shard_files(ckpt):
            if name not in listed:
                check.compare(name, None, _hash_file(os.path.join(ckpt, name)))
        return check
    name = os.path.basename(ckpt)
    check.compare(name, entries_for(where, listed, name), _hash_file(ckpt))
    return check


def load_manifest_for(checkpoint: str, manifest: str | None) -> tuple[str, dict[str, Any]] | None:
    """(manifest path, the entries for this checkpoint file) or None when there is none to use.

    An explicit `manifest` must exist and list the file (else AuditInputError); an implicit
    folder manifest that does not list the file is not this file's and is ignored.
    """
    where = manifest or find_manifest(checkpoint)
    if where is None:
        return None
    name = os.path.basename(checkpoint)
    entries = entries_for(where, _load(where).get("files", {}), name)
    if entries is None:
        if manifest:
            raise AuditInputError(f"{where}: does not list {name}")
        return None
    return where, entries
