"""Rules for faults outside the model's math: data-parallel replicas that stopped agreeing
(`replica_divergence`), a step that re-ran differently from the same inputs
(`nondeterministic`) and a checkpoint changed after its save (`checkpoint_corrupt`); and how a
re-run's verdict weighs the causes read from the run's numbers (`weigh_verdict`).
"""

from __future__ import annotations

from typing import Any

from nanguard.explain.evidence import Cause, Evidence
from nanguard.explain.rules.common import recovery_clause


def replica_divergence(ev: Evidence) -> Cause | None:
    """Needs: a replica_divergence alarm (nanguard.watch.replicas: data-parallel ranks whose
    parameters stopped agreeing bit for bit). Ruled out: none raised (or no process group)."""
    alarms = [a for a in ev.alarms if a["kind"] == "replica_divergence"]
    if not alarms:
        return None
    computed = [a for a in alarms if a.get("signal") == "rerun"]
    if computed:  # a cross-rank re-run: the parameters agree, one rank computes wrong
        a = computed[0]
        return Cause(
            cause="replica_divergence",
            confidence=0.9,
            evidence=f"step {a['step']}: {a['message']}",
            fix=f"take rank {int(a['value'])}'s device out of the job: it repeats a wrong result "
            "that its replicas do not compute (check its ECC counters, run a memory test or the "
            "vendor's diagnostics); resume every rank from the last checkpoint before the step "
            "whose manifest verifies (`nanguard audit CKPT`). The numbers measured after the "
            "step are the fault's, not the model's",
        )
    return Cause(
        cause="replica_divergence",
        confidence=0.8,
        evidence=f"step {alarms[0]['step']}: {alarms[0]['message']}",
        fix="the named rank's parameters changed without the others': suspect its device "
        "(memory errors: check the GPU's ECC counters, run a memory test) or code that updates "
        "parameters on one rank only; resume every rank from a checkpoint whose manifest "
        "verifies (`nanguard audit CKPT`)",
    )


def _rerun_text(r: dict[str, Any]) -> str:
    """What a re-run found, in words: the step, what differed, the setup it ran on."""
    what = "its replay" if r.get("source") == "nonfinite" else "its re-run"
    cross: dict[str, Any] = r["cross_rank"] if isinstance(r.get("cross_rank"), dict) else {}
    if r.get("verdict") == "persistent":
        return (f"rank {r.get('rank')} repeated step {r['step']} bit for bit while rank "
                f"{cross.get('peer', '?')} computed the same batch from the same parameters and "
                f"RNG states differently (persistent on rank {r.get('rank')}: a faulty device)")
    if r.get("verdict") == "reproducible" and cross:
        return (f"step {r['step']} re-ran bit for bit on rank {cross['rank']}, and on rank "
                f"{cross['peer']} from the same batch, parameters and RNG states")
    if r.get("verdict") == "reproducible":
        return (f"{what} of step {r['step']} from the same parameters, RNG states and batch "
                "reproduced it bit for bit")
    differed = []
    if r.get("loss_same") is False:
        differed.append("the loss")
    if r.get("differing"):
        differed.append(f"{r['differing']} gradient(s)")
    det = r.get("deterministic_algorithms")
    setup = [f"device {r['device']}"] if r.get("device") else []
    if det is not None:
        setup.append(f"deterministic algorithms {'on' if det else 'off'}")
    if differed:
        result = f"differed in {' and '.join(differed)}"
    elif r.get("source") == "nonfinite":
        result = "ran clean: no non-finite value"
    else:
        result = "gave another result"
    return (f"{what} of step {r['step']} from the same parameters, RNG states and batch "
            f"{result} (transient" + (f"; {', '.join(setup)}" if setup else "") + ")")


def weigh_verdict(ev: Evidence, cause: Cause) -> Cause:
    """A cause read from the run's numbers, weighed against the cascade's re-run verdict: a
    `reproducible` one is cited (software or data: the cause stands); after a `transient` one
    (`nondeterministic` leads) the cause drops to half its confidence and its fix, measured
    on the fault's magnitudes, gives way to "diagnose a run without the fault"."""
    r = ev.cascade_verdict()
    if r is None:
        return cause
    if r["verdict"] == "reproducible":
        cause.evidence += f"; {_rerun_text(r)}: software or data, not a fault"
        return cause
    cause.confidence = round(cause.confidence * 0.5, 3)
    if r["verdict"] == "persistent":
        cause.evidence += (f"; but {_rerun_text(r)}: the trouble began with that device's "
                           "fault (see `replica_divergence`), and what followed is its echo")
    else:
        cause.evidence += (f"; but {_rerun_text(r)}: the trouble began with a fault the same "
                           "inputs do not repeat, and what followed is its echo")
    # Its fix was measured on the fault's magnitudes (an LR cut from a 1e37x spike): none.
    cause.fix = ("only if it recurs once the fault is handled (see `nondeterministic`): "
                 "diagnose that run; the magnitudes measured here are the fault's and give no "
                 "LR or clip value")
    return cause


def nondeterministic(ev: Evidence) -> Cause | None:
    """Needs: the step the trouble began with (the first spike or the first non-finite step
    within the lead window, `Evidence.cascade_verdict`) re-ran differently from the same
    parameters, RNG states and batch (`transient`), or a replay that did not reproduce the
    failure bit for bit. Ruled out: a re-run that reproduced it, or none.

    Which suspect comes first follows the verdict's setup: on the CPU or with deterministic
    algorithms on, the kernels are deterministic, so the hardware (a flipped bit) or state
    outside the RNG; on an accelerator with them off, a non-deterministic kernel."""
    r = ev.cascade_verdict()
    if r is not None and r["verdict"] == "transient":
        det, device = r.get("deterministic_algorithms"), r.get("device")
        if det or device == "cpu":
            suspect = ("suspect the hardware first: the kernels were deterministic "
                       f"({'deterministic algorithms on' if det else 'CPU kernels'}); or state "
                       "the forward keeps outside the RNG (a counter, Python's `random`, a data "
                       "race)")
            fix = ("test the device (memory errors: ECC counters, a memory test; move the job "
                   "off it if a re-run there differs again); resume from the last checkpoint "
                   f"before the step (`nanguard audit CKPT` verifies it); {recovery_clause(ev)}")
        else:
            suspect = ("deterministic algorithms were off: a non-deterministic kernel (atomic "
                       "adds, autotuning) is the first suspect, a device fault the second")
            fix = ("rerun with `torch.use_deterministic_algorithms(True)`: a re-run that still "
                   "differs points at the device (memory errors: ECC counters, a memory test); "
                   f"resume from the last good checkpoint; {recovery_clause(ev)}")
        return Cause(cause="nondeterministic", confidence=0.9,
                     evidence=f"{_rerun_text(r)}: {suspect}", fix=fix)
    if ev.reproduced is not False or (r is not None and r["verdict"] == "persistent"):
        return None  # (persistent: this rank's replay ran clean, the fault is another rank's)
    return Cause(
        cause="nondeterministic",
        confidence=0.7,
        evidence="replaying the failing step from the same state, RNG and batch did not give "
        "the same result",
        fix="suspect hardware or a race: rerun with `torch.use_deterministic_algorithms(True)`; "
        "if it still differs, test the device (memory errors, a faulty GPU)",
    )


def checkpoint_corrupt(ev: Evidence) -> Cause | None:
    """Needs: a `checkpoint_mismatch` alarm (a checkpoint loaded under `nanguard run` whose
    tensors differ from the manifest written at its save). Ruled out: none raised (no manifest
    beside the file, or every tensor matched)."""
    alarms = [a for a in ev.alarms if a["kind"] == "checkpoint_mismatch"]
    if not alarms:
        return None
    return Cause(
        cause="checkpoint_corrupt",
        confidence=0.85,
        evidence=f"step {alarms[0]['step']}: {alarms[0]['message']}",
        fix="the checkpoint changed after it was saved (storage, a copy, or memory): resume "
        "from another copy or an earlier checkpoint whose manifest verifies (`nanguard audit "
        "CKPT`; `nanguard.load(path)` refuses one that does not)",
    )
