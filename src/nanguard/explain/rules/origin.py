"""Rules for where a non-finite value came from before any op made it: loaded state
(`checkpoint_nonfinite`), the script's own initialisation (`init_nonfinite`), the batch's
inputs (`data_nonfinite`) or its targets (`label_nonfinite`).
"""

from __future__ import annotations

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.rules.common import where_of


def _batch_evidence(ev: Evidence) -> bool:
    """The batch itself is shown to hold the value: rows of it (`samples`), the guard's
    non-finite batch tensors, or the op checker's batch element (`batch_item`); and it is not
    a value the guard found in the loaded state (`tensors`, see checkpoint_nonfinite)."""
    first = ev.first_nonfinite or {}
    if first.get("tensors"):
        return False
    return bool(ev.bad_tensors or first.get("batch_item") or first.get("samples")
                or _entered(ev).get("how") in ("batch", "target"))


def _entered(ev: Evidence) -> dict[str, object]:
    """Where the checker saw a batch value enter (`first_nonfinite.entered`): `how` (`batch`:
    a model input; `target`: a loss's target argument), `file` and `read` (the data file it
    came from, and how it was read)."""
    got = (ev.first_nonfinite or {}).get("entered")
    return got if isinstance(got, dict) else {}


def _scan(ev: Evidence) -> str:
    """`nanguard scan FILE` for the data file the value came from, else a placeholder."""
    path = _entered(ev).get("file")
    return f"`nanguard scan {path}`" if path else "`nanguard scan <your data file>`"


def _from_file(ev: Evidence) -> str:
    got = _entered(ev)
    return f"; it was read from {got['file']} ({got.get('read')})" if got.get("file") else ""


def _before_first_update(ev: Evidence) -> tuple[str, float] | None:
    """A value non-finite before the first update that no op made: (`found`: the guard's
    check of the state found `tensors`; `state`: the checker met a non-finite parameter at
    step 0; `unexplained`: step 0, phase `data`, no batch evidence), with a confidence."""
    first = ev.first_nonfinite or {}
    if ev.phase == "checkpoint" or first.get("tensors"):
        # `tensors` is the guard's checkpoint finding; a replay may have rewritten the phase.
        return "found", 0.97
    if ev.step == 0 and first.get("kind") == "state":
        return "state", 0.8
    if ev.step == 0 and ev.phase == "data" and not _batch_evidence(ev):
        return "unexplained", 0.6
    return None


def _state_tensors(ev: Evidence) -> list[str]:
    first = ev.first_nonfinite or {}
    tensors = [str(t) for t in first.get("tensors") or []]
    if not tensors and first.get("param"):
        tensors = [str(first["param"])]
    return tensors


def checkpoint_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `checkpoint` (weights, optimizer state or buffers already non-finite at the
    guard's first step, before any update), with `tensors` (their names) and `source` (the
    `file.py:LINE` of the load call, None when unknown); `tensors` alone counts too (a replay
    may have rewritten phase and source). Weaker, at step 0 only: a `state` value (a
    parameter the replay found non-finite before any op made it), or a `data` phase with no
    evidence that the batch holds the value.
    The event it needs: state was loaded (`Evidence.loaded` True, or unknown for a `Guard`
    created after a load).

    Ruled out: no load anywhere in the script (`nanguard run` tracks every `torch.load` /
    `load_state_dict`: init_nonfinite), the weaker forms after step 0 (an update may have
    made the value), and whenever the batch is shown to hold the value (data_nonfinite)."""
    found = _before_first_update(ev)
    if found is None or ev.loaded is False:
        return None
    form, conf = found
    first = ev.first_nonfinite or {}
    tensors = _state_tensors(ev)
    load = first.get("load_source") or (first.get("source") if ev.phase == "checkpoint"
                                         else None)
    if form == "found" and ev.phase != "checkpoint" and not first.get("load_source"):
        load = None  # `source` now names the replayed op's line, not the load call
    named = ", ".join(f"`{t}`" for t in tensors[:6]) + (" ..." if len(tensors) > 6 else "")
    what = named or "a tensor the batch does not hold"
    were = "were" if len(tensors) > 1 else "was"
    loaded = f"the state loaded at {load}" if load else (
        "loaded state (the load call's line is unknown)")
    if form == "found":
        evidence = (f"{what} {were} already non-finite at step {ev.step}, before the first "
                    f"update: {'they' if len(tensors) > 1 else 'it'} came with {loaded}")
    elif form == "state":
        evidence = (f"{what} {were} non-finite at step {ev.step} before any op made "
                    f"{'them' if len(tensors) > 1 else 'it'} and before the first update: "
                    f"{loaded}, presumably")
    else:
        evidence = (f"a value was non-finite at step {ev.step} although no batch tensor or row "
                    "is shown to hold it and no op made it (no tensor name recorded): "
                    f"{loaded}, presumably")
    ckpt = first.get("checkpoint") or "CKPT"
    fix = (f"`nanguard audit {ckpt}` lists every non-finite tensor of the checkpoint; resume "
           "from an earlier checkpoint (the last one saved before the run went non-finite)")
    if tensors and all(t.startswith("optimizer") for t in tensors):
        fix += ", or load the model weights only and start the optimizer state fresh"
    elif tensors and all(t.startswith("buffer:") for t in tensors):
        fix += ", or reset those buffers (BatchNorm: `module.reset_running_stats()`)"
    return Cause(
        cause="checkpoint_nonfinite",
        confidence=conf,
        evidence=evidence,
        fix=fix,
    )


def init_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: a parameter, optimizer-state tensor or buffer non-finite before the first
    update that no op made (the guard's check of the state, or the checker at step 0), AND no
    load anywhere in the script (`Evidence.loaded` False: `nanguard run` tracked every
    `torch.load` / `load_state_dict`): the script's own initialisation made it.
    Ruled out: a load seen or not knowable (checkpoint_nonfinite), no tensor named (a value
    that may be the batch's), the batch shown to hold the value (data_nonfinite)."""
    found = _before_first_update(ev)
    tensors = _state_tensors(ev)
    if found is None or found[0] == "unexplained" or ev.loaded is not False or not tensors:
        return None
    named = ", ".join(f"`{t}`" for t in tensors[:6]) + (" ..." if len(tensors) > 6 else "")
    were = "were" if len(tensors) > 1 else "was"
    module = (ev.first_nonfinite or {}).get("module")
    where = f" of `{module}`" if module else ""
    return Cause(
        cause="init_nonfinite",
        confidence=0.9 if found[0] == "found" else 0.75,
        evidence=f"{named} {were} non-finite at step {ev.step}, before any update, and the "
        "script loaded no state (no `torch.load` / `load_state_dict` call anywhere): its own "
        "initialisation made the value",
        fix=f"look at the initialisation{where} (a custom `reset_parameters`, `nn.init` call "
        "or in-place write to the weights); "
        + ("`nanguard run --preflight-only <your script> ...`" if ev.entry == "run"
           else "`nanguard preflight`")
        + " checks every layer's init before training",
    )


_LABEL_KEYS = ("y", "target", "targets", "label", "labels")

_LOSS_OPS = ("aten.mse_loss", "aten.l1_loss", "aten.smooth_l1_loss", "aten.huber_loss",
             "aten.nll_loss", "aten.cross_entropy", "aten.binary_cross_entropy", "aten.kl_div")


def _only_targets(ev: Evidence) -> bool:
    """The non-finite value is in the batch's last element (the targets), not the inputs."""
    first = ev.first_nonfinite or {}
    if ev.bad_tensors:  # the guard read the batch tensors themselves
        return ev.n_batch_tensors > 1 and ev.bad_tensors == [ev.n_batch_tensors - 1]
    how = _entered(ev).get("how")
    if how in ("target", "batch"):  # the checker followed it to a loss target / the model
        return how == "target"
    if first.get("module") is None and str(first.get("op") or "").startswith(_LOSS_OPS):
        return True  # first consumed by the loss, outside every module: not a model input
    item = str((ev.first_nonfinite or {}).get("batch_item") or "")  # e.g. "[1]" or "['y']"
    key = item.strip("[]'\"")
    if key in _LABEL_KEYS:
        return True
    return key.isdigit() and ev.n_batch_tensors > 1 and int(key) == ev.n_batch_tensors - 1


def _batch_held(ev: Evidence) -> bool:
    """The batch held the value before the step: phase `data` with evidence that the batch
    holds it (`_batch_evidence`), or, whatever op first touched it and in whichever phase the
    origin was put, the guard's own check of the batch found non-finite batch tensors."""
    if ev.phase == "data":  # a cast that overflowed on reading is the op's, not the data's
        return _batch_evidence(ev) and not _made_in_step(ev)
    return (bool(ev.bad_tensors) and not (ev.first_nonfinite or {}).get("tensors")
            and not _made_in_step(ev))


def _made_in_step(ev: Evidence) -> bool:
    """The checker saw the origin op make the value from finite inputs (`kind` op, every
    recorded input finite): the model's input was computed in the step, after the batch was
    loaded (`x = (x - x.mean(0)) / x.std(0)` on a constant column), so the batch the guard
    checked held the op's output, not the loaded data. A batch that held the value itself
    reaches its first op as a non-finite input."""
    first = ev.first_nonfinite or {}
    inputs = first.get("inputs") or []
    return (first.get("kind") == "op" and bool(inputs)
            and not any(i.get("nonfinite") for i in inputs))


def _first_reader(ev: Evidence) -> str:
    """`; {op} ({phase}) only read it first` when the origin names another phase than data."""
    if ev.phase in ("data", "") or not ev.op:
        return ""
    return f"; {where_of(ev)} was only the first op to read it"


def data_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: phase `data` and evidence that the batch holds the value: its rows (`samples`),
    the guard's non-finite batch tensors, or the checker's batch element (`batch_item`); or, in
    any phase, the guard's non-finite batch tensors (the batch held the value whichever op
    first touched it: a collate `stack`, `.float()`, the first layer).
    Ruled out: no such evidence (samples [] and no bad batch tensor: e.g. a loaded tensor,
    see checkpoint_nonfinite), or a watched batch found finite; only the targets
    (label_nonfinite)."""
    if not _batch_held(ev):
        return None
    if _only_targets(ev):
        return None  # only the targets: label_nonfinite
    samples = (ev.first_nonfinite or {}).get("samples") or []
    rows = f"samples {samples[:8]}" if samples else "rows unknown"
    return Cause(
        cause="data_nonfinite",
        confidence=0.95,
        evidence=f"the batch at step {ev.step} already holds NaN/Inf in its inputs ({rows}), "
        f"before any op computed on it{_first_reader(ev)}{_from_file(ev)}",
        fix=f"drop or repair those rows at load time; find all of them with {_scan(ev)}"
        + (" (or nanguard.audit.scan_dataset(dataset))" if ev.entry != "run" else ""),
    )


def _target_line(ev: Evidence) -> str:
    got = _entered(ev)
    if got.get("how") != "target":
        return ""
    return f"; it reached the loss as its target ({got.get('op')} at {got.get('source')})"


def label_nonfinite(ev: Evidence) -> Cause | None:
    """Needs: evidence that the batch holds the value (as data_nonfinite), and only the last
    batch tensor (the targets) non-finite. Ruled out: inputs non-finite too."""
    if not _batch_held(ev) or not _only_targets(ev):
        return None
    samples = (ev.first_nonfinite or {}).get("samples") or []
    return Cause(
        cause="label_nonfinite",
        confidence=0.95,
        evidence=f"the targets of step {ev.step} hold NaN/Inf (samples {samples[:8]}); "
        f"the inputs are finite{_first_reader(ev)}{_target_line(ev)}{_from_file(ev)}",
        fix=f"fix or drop those labels; {_scan(ev)} lists every row holding NaN/Inf, the "
        "target column's among them",
    )
