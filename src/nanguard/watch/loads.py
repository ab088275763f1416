"""Where state was loaded from: the user's line that called `load_state_dict` / `torch.load`.

A value that is non-finite before the first update was not produced by training: it came
with loaded state (a checkpoint's weights, optimizer state or buffers). The report then names
the tensor and the line that loaded it. The guard learns the line two ways:

* its own `load_state_dict` post-hooks on the model and optimizer (state loaded after the
  guard was created, e.g. a resume in the middle of a script);
* `track()`, installed by `nanguard run` for the whole script (state loaded before any guard
  exists): it wraps `torch.load`, `nn.Module.load_state_dict` and
  `Optimizer.load_state_dict` to remember the last call site. Removed by `untrack()`.

Under `track()`, a `torch.load` of a file that has a manifest beside it (`nanguard.save`,
`nanguard.audit.write_manifest`) is verified against it, from the loaded tensors in memory:
a tensor whose bytes changed since the save is an ERROR line at once, and the guard's first
step after it records a `checkpoint_mismatch` alarm naming the tensors (`take_mismatches`).
Tensors only: a scalar saved as an object's repr cannot be compared after a full unpickle.

Each loaded tensor keeps the line that loaded it: a module's `load_state_dict` marks its
parameters and buffers, an optimizer's its state tensors (by identity, weakly), so a resume
that loads the weights on one line and the optimizer on the next names the right one.

`finiteness_flags` puts one flag per loaded tensor into the first step's packet (no extra
host read); `finding` turns the flags read with it into report.json's `first_nonfinite`.
Nothing here reads a device value.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from nanguard.detect.alarm import Alarm
from nanguard.detect.locate import owner
from nanguard.watch.norms import local

_OWN = (str(Path(torch.__file__).parent), str(Path(__file__).parents[1]))
_last: str | None = None
_patched: list[tuple[Any, str, Any]] = []
_any = False
"""Whether any load was seen since the last `track()` (kept after `untrack()`: the report of
a `nanguard run` is written once the script's hooks are gone)."""
_sites: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
"""id(tensor) -> (the tensor, weakly; the line whose load wrote it)."""
_files: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
"""id(tensor) -> (the tensor, weakly; the file `torch.load` read it from)."""
_data_files: list[str] = []
"""Files read with NumPy under `track()`: the data a batch value may have come from."""
_read: dict[str, tuple[int, int]] = {}
"""Absolute path -> (size, mtime_ns) of each file `torch.load` read under `track()`, as it was
when read (`run.resume_state` finds the guard state saved with a checkpoint by it)."""
_mismatches: list[dict[str, Any]] = []
_loaded_lr: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
"""Each optimizer whose state was loaded -> its first group's LR right after the load (the LR
the checkpoint was saved at; `policy.lr_change`: a resume's first step may jump from it)."""
"""Loaded checkpoints that differ from their manifests, not yet recorded by a guard."""


class LoadedNames(list[str]):
    """The names `finiteness_flags` returns, with `sites`: the line that loaded each tensor
    (None when unknown), carried with the names to `finding`."""

    sites: list[str | None]


def call_site() -> str | None:
    """`file:line` of the innermost frame outside torch and nanguard (the user's call)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_OWN) and not name.startswith("<frozen"):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def note(site: str | None, loaded: Any = None) -> None:
    """Remember `site` as the last place state was loaded (None: a load, line unknown) and,
    given the module or optimizer that `load_state_dict` loaded, as the line of each of its
    tensors."""
    global _last, _any
    _any = True
    if isinstance(loaded, torch.optim.Optimizer) and loaded.param_groups:
        lr = loaded.param_groups[0].get("lr")
        if isinstance(lr, (int, float)):
            _loaded_lr[loaded] = float(lr)
    if site is not None:
        _last = site
        for t in _tensors_of(loaded):
            _sites[id(t)] = (weakref.ref(t), site)


def _tensors_of(loaded: Any) -> list[torch.Tensor]:
    if isinstance(loaded, torch.nn.Module):
        return [*loaded.parameters(), *loaded.buffers()]
    if isinstance(loaded, torch.optim.Optimizer):
        return [v for st in loaded.state.values() for v in st.values()
                if isinstance(v, torch.Tensor)]
    return []


def site_of(t: torch.Tensor) -> str | None:
    """The line whose `load_state_dict` wrote `t`, when one did."""
    hit = _sites.get(id(t))
    return hit[1] if hit is not None and hit[0]() is t else None


def loaded_lr(optimizer: Any) -> float | None:
    """The LR `optimizer` had right after its state was last loaded (a load seen by `track()`
    or a guard's hooks), else None."""
    return _loaded_lr.get(optimizer)


def load_seen(whole_script: bool) -> bool | None:
    """Whether state was loaded: True when a load was seen; False when none was and loads
    were tracked for the whole script (`whole_script`: `nanguard run`); None when unknown (a
    `Guard` sees only the loads after it was created)."""
    if _any:
        return True
    return False if whole_script else None


def last_site() -> str | None:
    """The last load call site seen by `track()` or a guard's hooks (None if none)."""
    return _last


def _wrap(owner: Any, attr: str) -> None:
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        site = call_site()
        note(site)
        out = original(*args, **kwargs)
        if attr == "load_state_dict" and args:  # after it: the optimizer's state is new
            note(site, args[0])
        elif attr == "load":
            path = args[0] if args else kwargs.get("f")
            if isinstance(path, (str, os.PathLike)):
                verify(out, os.fspath(path), site)
                _note_file(out, os.fspath(path))
                _note_read(os.path.abspath(os.fspath(path)))
        return out

    _patched.append((owner, attr, original))
    setattr(owner, attr, wrapper)


def _note_file(loaded: Any, path: str, depth: int = 0) -> None:
    """Remember `path` as the file of each tensor `torch.load` returned (in dicts, lists and
    tuples, two levels deep): a data set saved as tensors is named by its file."""
    if isinstance(loaded, torch.Tensor):
        _files[id(loaded)] = (weakref.ref(loaded), path)
    elif depth < 2 and isinstance(loaded, dict):
        for v in list(loaded.values())[:64]:
            _note_file(v, path, depth + 1)
    elif depth < 2 and isinstance(loaded, (list, tuple)):
        for v in loaded[:64]:
            _note_file(v, path, depth + 1)


def stamp(path: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of the file at `path`: which version of it was read or written; None
    when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


def _note_read(path: str) -> None:
    if (st := stamp(path)) is not None:
        _read[path] = st


def files_read() -> dict[str, tuple[int, int]]:
    """Each file `torch.load` read under `track()`: absolute path -> (size, mtime_ns) when
    read."""
    return dict(_read)


def file_of(t: torch.Tensor) -> str | None:
    """The file `torch.load` read `t` from (under `track()`), when it did."""
    hit = _files.get(id(t))
    return hit[1] if hit is not None and hit[0]() is t else None


def data_files() -> list[str]:
    """The files the script read with NumPy (`np.load`, `np.loadtxt`, `np.genfromtxt`)
    under `track()`, in order, without repeats."""
    return list(dict.fromkeys(_data_files))


def verify(loaded: Any, path: str, site: str | None) -> None:
    """Compare what `torch.load(path)` returned with the manifest beside `path`, if any (see
    the module docstring). Never raises: a file nanguard cannot verify loads as it would."""
    try:
        from nanguard.audit.load import verify_loaded

        check = verify_loaded(loaded, path)
    except Exception:  # noqa: BLE001 - verifying must never break the user's load
        return
    if check is None:
        return
    changed = [m for m in check.mismatches if m.kind == "tensor"]
    if changed:
        report_mismatch(path, check.manifest, site, [m.name for m in changed])


def report_mismatch(path: str, manifest: str, site: str | None, names: list[str]) -> None:
    """A checkpoint at `path` differs from its `manifest` in `names` (tensors, or files of a
    checkpoint folder): an ERROR line now, and a `checkpoint_mismatch` alarm at the next
    guard step (`take_mismatches`). Framework adapters that verify their checkpoints call it."""
    from nanguard.audit.manifest_check import why_changed

    _mismatches.append({"path": path, "manifest": manifest, "site": site, "tensors": names})
    logging.getLogger("nanguard").error(
        "%s (loaded at %s) differs from its manifest in %d tensor(s): %s -- %s; training goes "
        "on from these values; `nanguard audit %s` lists every difference", path, site or "?",
        len(names), ", ".join(names[:5]) + (" ..." if len(names) > 5 else ""),
        why_changed(path, manifest), path)


def take_mismatches() -> list[dict[str, Any]]:
    """The checkpoints found differing from their manifests since the last call."""
    out = list(_mismatches)
    _mismatches.clear()
    return out


def mismatch_alarm(step: int, found: dict[str, Any]) -> Alarm:
    """The `checkpoint_mismatch` alarm for one entry of `take_mismatches`, at `step` (the first
    step after the load)."""
    names = found["tensors"]
    return Alarm(step=step, kind="checkpoint_mismatch", signal="checkpoint",
                 value=float(len(names)),
                 message=f"{found['path']} (loaded at {found['site'] or '?'}) differs from its "
                 f"manifest in {len(names)} tensor(s): {', '.join(names[:5])}"
                 + (" ..." if len(names) > 5 else ""))


def track() -> None:
    """Remember the call site of every `torch.load` / `load_state_dict` (idempotent)."""
    global _any
    if _patched:
        return
    _any = False
    _sites.clear()
    _wrap(torch, "load")
    _wrap(torch.nn.Module, "load_state_dict")
    _wrap(torch.optim.Optimizer, "load_state_dict")
    _files.clear()
    _data_files.clear()
    _read.clear()
    try:
        import numpy
    except ImportError:  # no NumPy: no NumPy reads to name
        return
    for name in ("load", "loadtxt", "genfromtxt"):
        _wrap_read(numpy, name)


def _wrap_read(owner: Any, attr: str) -> None:
    """Wrap a data-file reader (NumPy's): the path it read joins `data_files()`. Not a load
    of state: `note` is not called."""
    original = getattr(owner, attr)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        path = args[0] if args else kwargs.get("fname", kwargs.get("file"))
        if isinstance(path, (str, os.PathLike)):
            _data_files.append(os.fspath(path))
        return original(*args, **kwargs)

    _patched.append((owner, attr, original))
    setattr(owner, attr, wrapper)


def untrack() -> None:
    """Undo `track()`."""
    global _last
    while _patched:
        owner, attr, original = _patched.pop()
        setattr(owner, attr, original)
    _last = None


def finiteness_flags(
    param_names: list[str], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
    buffer_names: list[str], buffers: list[torch.Tensor],
) -> tuple[list[str], torch.Tensor | None]:
    """Names of every floating parameter, optimizer-state tensor and buffer, and a device
    vector of their finiteness flags (1.0 finite, 0.0 not). DTensors (FSDP2): each rank checks
    its own shard; the finding is per rank."""
    named: list[tuple[str, torch.Tensor]] = list(zip(param_names, params, strict=True))
    for name, p in zip(param_names, params, strict=True):
        for key, v in optimizer.state.get(p, {}).items():
            if key != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                named.append((f"optimizer.{key}[{name}]", v))
    named += [(f"buffer:{n}", b) for n, b in zip(buffer_names, buffers, strict=True)]
    named = [(n, t) for n, t in named if t.numel() and (t.is_floating_point() or t.is_complex())]
    if not named:
        return [], None
    with torch.no_grad():
        device = local(named[0][1]).device
        flags = torch.stack([torch.isfinite(local(t.detach())).all().to(device)
                             for _, t in named])
    names = LoadedNames(n for n, _ in named)
    names.sites = [site_of(t) for _, t in named]
    return names, flags.double()


def finding(step: int, names: list[str], flags: list[float], source: str | None
            ) -> dict[str, Any] | None:
    """report.json's `first_nonfinite` for loaded state (phase `checkpoint`: the tensors that
    were non-finite before training touched them, and the line that loaded them), or None when
    every flag says finite. The caller adds the rank."""
    bad = [n for n, ok in zip(names, flags, strict=True) if not ok]
    if not bad:
        return None
    # The line that loaded the first bad tensor itself, before the last load line seen.
    sites = dict(zip(names, getattr(names, "sites", None) or [None] * len(names),
                     strict=True))
    own = {n: sites[n] for n in bad if sites.get(n)}
    source = own.get(bad[0]) or source
    signals = sorted({"buffer" if n.startswith("buffer:") else
                      n.split("[")[0] if n.startswith("optimizer.") else "param" for n in bad})
    first = bad[0]
    param = first.split("[", 1)[1].rstrip("]") if first.startswith("optimizer.") else (
        None if first.startswith("buffer:") else first)
    module = owner(param) if param else owner(first.removeprefix("buffer:"))
    found = {"step": step, "phase": "checkpoint", "module": module, "op": None,
             "source": source, "samples": [], "rank": None, "signals": signals, "param": param,
             "tensors": bad}
    if len(set(own.values())) > 1:  # loaded on several lines: each tensor's own
        found["load_sources"] = own
    return found
