"""Checkpoint manifests for the framework adapters: written after the framework saved a
checkpoint, verified before it resumes from one (`manifests=True` on the Lightning and
transformers callbacks).

Both never raise: a manifest that cannot be written is a warning line, a checkpoint that
cannot be verified loads as the framework would load it. A checkpoint that differs from its
manifest is reported through `watch.loads.report_mismatch`: an ERROR line at once and a
`checkpoint_mismatch` alarm at the guard's next step (training goes on: the monitor does not
decide whether a resume may proceed).
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("nanguard")


def write(checkpoint: str | os.PathLike[str]) -> str | None:
    """Write the manifest of a checkpoint file or folder just saved (tensors hashed one by
    one; files that cannot be opened without running pickled code, by their bytes). Runs on
    the calling thread: one sha256 pass over the checkpoint. Returns the manifest's path, or
    None when it could not be written (logged)."""
    from nanguard.audit.manifest import write_manifest

    try:
        return write_manifest(os.fspath(checkpoint))
    except Exception as exc:  # noqa: BLE001 - a manifest must never break a save
        log.warning("could not write the manifest of %s (%s: %s); the checkpoint itself is "
                    "saved", os.fspath(checkpoint), type(exc).__name__, exc)
        return None


def verify(checkpoint: str | os.PathLike[str], site: str) -> bool | None:
    """Verify a checkpoint file or folder against its manifest before a resume reads it.

    Args:
        checkpoint: the file or folder the framework is about to load.
        site: what loads it, for the message (e.g. `Trainer.train(resume_from_checkpoint)`).

    Returns:
        True when it matches, False when it differs (reported), None when there is no manifest
        or it could not be read.
    """
    from nanguard.audit.manifest import find_manifest, verify_manifest
    from nanguard.watch import loads

    path = os.fspath(checkpoint)
    if find_manifest(path) is None:
        return None
    try:
        check = verify_manifest(path)
    except Exception as exc:  # noqa: BLE001 - an unverifiable checkpoint loads as it would
        log.warning("could not verify %s against its manifest (%s: %s)", path,
                    type(exc).__name__, exc)
        return None
    if check.ok:
        return True
    names = [m.name if m.kind != "file" else m.file for m in check.mismatches]
    loads.report_mismatch(path, check.manifest, site, names)
    return False
