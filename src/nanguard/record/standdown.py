"""What is kept when nanguard stands down after an error in its own code.

The traceback goes to `nanguard_error.txt` in the run folder, the error to run.db's meta (the
report's `run.internal_error`, status `degraded`), and one line to stderr. Nothing here raises:
recording the error must not become a second one.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from nanguard.record.store import NullStore


def note_internal_error(exc: BaseException, where: str, step: int, folder: Path | None,
                        store: NullStore) -> dict[str, Any]:
    """Record nanguard's own error `exc` (raised in `where` at `step`) and say so once.
    Returns report.json's `run.internal_error` (`step`, `where`, `error`, `traceback`)."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    error: dict[str, Any] = {"step": step, "where": where,
                             "error": f"{type(exc).__name__}: {exc}"}
    try:
        if folder is not None:
            (folder / "nanguard_error.txt").write_text(text)
            error["traceback"] = str(folder / "nanguard_error.txt")
        store.write_meta(internal_error=error)
    except Exception:  # noqa: BLE001, S110 - recording the error must not raise either
        pass
    print(f"nanguard: internal error in {where} at step {step} "
          f"({type(exc).__name__}: {exc}); nanguard stands down, training goes on"
          + (f"; traceback in {folder / 'nanguard_error.txt'}" if folder else ""),
          file=sys.stderr)
    return error
