"""Gather the diagnosis evidence from a run log (what the run saw, the optimizer's settings)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nanguard.explain.evidence import Evidence


def evidence_from_run(log: Mapping[str, Any], optimizer: Any) -> Evidence:
    """Evidence for `diagnose` from a live run: `evidence_from_log(log)` (the guard's
    `run_log()`), whether state was loaded (`watch/loads.py`: `nanguard run` tracks the whole
    script) and the optimizer's weight decay. Plain inputs: explain never imports the Guard."""
    from nanguard.watch import loads

    ev = evidence_from_log(log)
    ev.loaded = loads.load_seen(whole_script=ev.entry == "run")
    ev.weight_decay, ev.decoupled_decay = _weight_decay(optimizer)
    return ev


_DECOUPLED = ("AdamW", "SGD", "Lion", "ManualStep")
"""Optimizers whose weight decay multiplies the weights by (1 - lr * wd) each step."""


def _weight_decay(optimizer: Any) -> tuple[float | None, bool]:
    """(largest weight_decay of the groups, whether it acts multiplicatively)."""
    groups = getattr(optimizer, "param_groups", None) or []
    decays = [float(g["weight_decay"]) for g in groups
              if isinstance(g.get("weight_decay"), (int, float))]
    if not decays:
        return None, False
    decoupled = type(optimizer).__name__ in _DECOUPLED or any(
        g.get("decoupled_weight_decay") for g in groups)
    return max(decays), decoupled


def evidence_from_log(log: Mapping[str, Any]) -> Evidence:
    """Evidence for `diagnose` from a run log (`Guard.run_log()`: plain data, the same a
    `Guard.state_dict()` carries), never from the Guard itself.

    Keys read (each optional): `first_nonfinite`, `alarms`, `optimizer` (`name`, `lr`,
    `momentum`, `eps`, `dtype`), `failing` (the first failing step: `lr`, `bad_tensors`,
    `n_batch_tensors`), `healthy_grad_norm`, `history` (step records), `actions`, `lead_window`,
    `script_clip` (the `max_norm` of the script's own clipping, 0 when off), `script_argv`
    (the script's command line), `entry` (`run` for
    `nanguard run`, else `api`), `preflight` (`nanguard run --preflight`'s verdict) and
    `spikes` (their `rerun` verdicts, with `first_nonfinite.verdict`: `Evidence.reruns`).
    """
    opt = log.get("optimizer") or {}
    failing = log.get("failing") or {}
    first = log.get("first_nonfinite")
    return Evidence(
        first_nonfinite=first,
        alarms=list(log.get("alarms") or []),
        optimizer=opt.get("name"),
        # The LR of the failing step (a scheduler may have moved it since), else the current.
        lr=_float_or_none(failing.get("lr")) if failing.get("lr") is not None
        else _float_or_none(opt.get("lr")),
        momentum=_float_or_none(opt.get("momentum")),
        eps=_float_or_none(opt.get("eps")),
        # The dtype the origin op computed in (autocast!), else the parameters' one.
        dtype=((first or {}).get("output") or {}).get("dtype") or opt.get("dtype"),
        healthy_grad_norm=_float_or_none(log.get("healthy_grad_norm")),
        bad_tensors=list(failing.get("bad_tensors") or []),
        n_batch_tensors=int(failing.get("n_batch_tensors") or 0),
        reproduced=(first or {}).get("reproduced"),
        lead_window=int(log.get("lead_window") or 10),
        history=list(log.get("history") or []),
        clip=_float_or_none(log.get("script_clip")),
        argv=_strings(log.get("script_argv")),
        entry=str(log.get("entry") or "api"),
        preflight=_preflight(log.get("preflight")),
        actions=list(log.get("actions") or []),
        reruns=_reruns(log.get("spikes") or [], first),
    )


def _reruns(spikes: list[dict[str, Any]], first: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The re-run verdicts of the log, oldest first (`Evidence.reruns`): each spike's
    `rerun` (its step's re-run before the update) and the first non-finite step's `verdict`
    (its replay). Steps without a verdict (the re-run could not run) are left out."""
    found = [{"step": sp["step"], "source": "spike", **sp["rerun"]} for sp in spikes
             if isinstance(sp.get("rerun"), dict) and sp["rerun"].get("verdict")
             and isinstance(sp.get("step"), int)]
    if first and first.get("verdict") and isinstance(first.get("step"), int):
        found.append({"step": first["step"], "source": "nonfinite", "verdict": first["verdict"],
                      **{k: first[k] for k in ("deterministic_algorithms", "device",
                                               "cross_rank", "local_verdict") if k in first}})
        if isinstance(first.get("cross_rank"), dict):  # `persistent` on this rank
            found[-1]["rank"] = first["cross_rank"].get("rank")
    # A spike and the non-finite value in one step: the spike's re-run compares more.
    return sorted(found, key=lambda r: (r["step"], r["source"] != "spike"))


def _preflight(v: object) -> dict[str, Any] | None:
    return v if isinstance(v, dict) and v.get("ran") else None


def _float_or_none(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _strings(v: object) -> list[str] | None:
    return [str(a) for a in v] if isinstance(v, (list, tuple)) else None
