"""A script resumed under `nanguard run` starts from the guard of the run it resumes.

A guard's statistics (the detectors' windows, heal's rolling grad norm, the LR of the last
step, the loss level, the step count) ride with a checkpoint only when the script saves
`Guard.state_dict()` into it; a script that `nanguard run` watches knows nothing of a guard.
Without them a resumed run starts blind: its step count restarts at 0, every detector waits for
a new warm-up, and the spike a resume without warm-up makes in its first steps goes unjudged
(issue 40 item 3: a nanoGPT resumed at 10x its LR peaked at 5.0 and every policy ended
`healthy`). So the run keeps them for the script:

* save: `track` wraps `torch.save`. Right after the script saves to a file (a path, not a
  buffer) while optimizers are watched, each guard's `state_dict()` is written beside its run
  folder's record, `resume/<key>.pt` (key: a hash of the checkpoint's absolute path), with the
  checkpoint's path, size and modification time: the file the state belongs to. A later save
  over the same path replaces both.
* load: each `torch.load` of a file is noted by `watch.loads.track` (its path, size and
  modification time: `loads.files_read`).
* `restore`, when a guard is created (at the script's first optimizer step, after it loaded
  its checkpoint): a state saved for a checkpoint the script loaded, whose size and time still
  match it, found in the run folders beside this one (the parent of `--out`, where
  `nanguard_runs/<time>` folders go by default), the newest first; guard n of the script takes
  the state of guard n. The guard then counts steps on from the saved step (its records and
  live lines use the script's own iteration numbers), judges the first steps after the resume
  like any others, names an LR jump at the resume against the LR at save, and compares the
  loss right after the resume with the loss at save (`recover.loss_after`).

Cost: one `state_dict()` per checkpoint save (a flush and a few KB written), one `stat` per
load; nothing on a training step. Fails open: a state that cannot be written, read or loaded
is logged at debug level and the run goes on as it would have without it. The state file is
read with `weights_only=True` (never an untrusted pickle).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from nanguard.watch import loads

log = logging.getLogger("nanguard")

FOLDER = "resume"
"""The subfolder of a run folder that holds the guard states saved with the script's
checkpoints."""

def _key(path: str) -> str:
    return hashlib.sha1(path.encode()).hexdigest()[:16]


def _file_of(f: Any) -> str | None:
    """The absolute path of a `torch.save` target, or None for a buffer."""
    if isinstance(f, (str, os.PathLike)):
        return os.path.abspath(os.fspath(f))
    return None


def track(watched: Callable[[], Iterable[Any]]) -> Callable[[], None]:
    """Wrap `torch.save` for the script's run (see the module docstring; its loads are noted
    by `watch.loads.track`, installed first).

    Args:
        watched: gives the run's `Watched` parts (each with `index`, `guard`, `folder`).

    Returns:
        The undo: puts back the function it replaced, unless something wrapped it since.
    """
    save = torch.save

    @functools.wraps(save)
    def saving(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        out = save(obj, f, *args, **kwargs)
        path = _file_of(f)
        if path is not None:
            try:
                _save_states(path, list(watched()), save)
            except Exception as exc:  # noqa: BLE001 - a monitor never breaks training
                log.debug("nanguard: guard state not saved with %s: %s", path, exc)
        return out

    torch.save = saving

    def undo() -> None:
        if torch.save is saving:
            torch.save = save

    return undo


def _save_states(path: str, parts: list[Any], save: Callable[..., Any]) -> None:
    """Each watched guard's state, for the checkpoint just written to `path`."""
    stamp = loads.stamp(path)
    if stamp is None:
        return
    for w in parts:
        if w.guard is None or w.folder is None:
            continue
        state = w.guard.state_dict()
        folder = Path(w.folder) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{_key(path)}.tmp"
        save({"checkpoint": path, "size": stamp[0], "mtime_ns": stamp[1], "index": w.index,
              "state": state}, tmp)
        tmp.replace(folder / f"{_key(path)}.pt")  # never half a state under the real name


def restore(w: Any) -> dict[str, Any] | None:
    """Give the new guard of `w` the state saved with a checkpoint the script loaded (see the
    module docstring). Returns what was restored (`checkpoint`, `from`: the run folder, `step`)
    or None."""
    read = loads.files_read()
    if w.guard is None or not read:
        return None
    try:
        found = _find(Path(w.folder), w.index, read)
        if found is None:
            return None
        source, saved = found
        w.guard.load_state_dict(saved["state"])
    except Exception as exc:  # noqa: BLE001 - fail open: the guard starts fresh, as before
        log.debug("nanguard: no guard state restored at the resume: %s", exc)
        return None
    done = {"checkpoint": saved["checkpoint"], "from": str(source),
            "step": int(saved["state"].get("step", 0))}
    log.info("nanguard: resumed from %s: the guard goes on from the state of %s at step %d",
             done["checkpoint"], done["from"], done["step"])
    return done


def _find(folder: Path, index: int, read: dict[str, tuple[int, int]]
          ) -> tuple[Path, dict[str, Any]] | None:
    """The newest state saved for a checkpoint the script read (`read`: path -> stamp) that
    still matches it, in the run folders beside this run's (`folder` is `--out`/optimizer-N
    while the run goes on; a run with one optimizer has it merged into `--out` at its end)."""
    keys = {_key(p): (p, stamp) for p, stamp in read.items()}
    own = folder.resolve().parent  # this run's --out
    files = [f for pattern in (f"*/{FOLDER}/*.pt", f"*/optimizer-*/{FOLDER}/*.pt")
             for f in own.parent.glob(pattern) if f.stem in keys and own not in f.parents]
    for f in sorted(files, key=lambda f: f.stat().st_mtime_ns, reverse=True):
        saved = torch.load(f, weights_only=True)  # never an untrusted pickle
        path, stamp = keys[f.stem]
        if (isinstance(saved, dict) and saved.get("checkpoint") == path
                and (saved.get("size"), saved.get("mtime_ns")) == stamp
                and saved.get("index") == index and isinstance(saved.get("state"), dict)):
            return f.parent.parent, saved  # the run folder it was saved in
    return None
