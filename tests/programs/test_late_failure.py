"""A failure thousands of steps into a run is pinpointed where it happens, in process: no re-run
of the script from its start (`nanguard run` records each step's model call and loss by
reference and the guard replays the failing step under the op checker before its update).

The scripts run black box through `nanguard run`. The expected step and phase come from the same
script under the independent tracer (`scripts/_nantrace.py`) and from the script's own schedule;
the op and source line from the script's text. A script whose loss is the script's own
arithmetic cannot be replayed in process: it still gets its origin from the re-run.
"""

from __future__ import annotations

from pathlib import Path

import torch
from programs_support import SCRIPTS, both, guarded, plain, script_line

LATE = "prior_decay.py"


def _anneal_zero(anneal_steps: int, steps: int) -> int:
    """The first step whose prior scale `|1 - step / anneal_steps|` (the script's schedule) is
    exactly 0: the step whose `log(prior)` is -inf."""
    return next(s for s in range(steps) if abs(1.0 - s / anneal_steps) == 0.0)


def test_failure_thousands_of_steps_in_is_pinpointed_in_process(tmp_path: Path) -> None:
    """The prior reaches 0 at step 3000; with a 0.5 s budget a re-run of the script from its
    start could not even import torch, yet the origin is found: the log in the `head` module,
    in the forward of step 3000, at its source line, reproduced bit for bit (dropout and a
    fresh random batch each step: the RNG states are the forward's own)."""
    anneal, steps = 3000, 3002
    traced, g = both(tmp_path, LATE, "--steps", str(steps), "--anneal-steps", str(anneal),
                     options=("--replay-budget", "0.5"))
    step = _anneal_zero(anneal, steps)
    assert traced.first == {"step": step, "phase": "forward", "module": "head"}, traced
    first = g.report.get("first_nonfinite") or {}
    got = {"status": g.report["status"], "exit": g.proc.returncode,
           "replay": g.report["run"].get("replay"),
           **{k: first.get(k) for k in ("step", "phase", "module", "op", "source",
                                        "reproduced")},
           "cause": g.report["diagnosis"][0]["cause"] if g.report.get("diagnosis") else None}
    want = {"status": "failed", "exit": 1, "replay": {"status": "in-process", "step": step},
            "step": step, "phase": "forward", "module": "head", "op": "aten.log",
            "source": f"{SCRIPTS / LATE}:{script_line(LATE, 'torch.log(prior)')}",
            "reproduced": True, "cause": "log_of_nonpositive"}
    assert got == want, g.explain()
    assert "ran out of its budget" not in g.proc.stderr


def test_late_failure_under_gradient_accumulation_is_pinpointed_in_process(
        tmp_path: Path) -> None:
    """A late failure with `--grad-accum 4` (four micro-batches per update, each loss divided
    by 4 before its backward): the step's micro-batches are replayed one by one in process, and
    the first one already makes the -inf (the prior is the same for all four). 300 updates
    (1,200 micro-batches) in, not thousands: that a failure thousands of steps in is replayed
    in process is the test above; here the 0.5 s budget alone already rules out a re-run from
    the start (it cannot import torch), so an `in-process` replay is all this could be."""
    anneal, steps = 300, 302
    traced, g = both(tmp_path, LATE, "--steps", str(steps), "--anneal-steps", str(anneal),
                     "--grad-accum", "4", options=("--replay-budget", "0.5"))
    step = _anneal_zero(anneal, steps)
    assert traced.first == {"step": step, "phase": "forward", "module": "head"}, traced
    first = g.report.get("first_nonfinite") or {}
    got = {"replay": g.report["run"].get("replay"),
           **{k: first.get(k) for k in ("step", "phase", "module", "op", "source",
                                        "micro_batch")},
           "cause": g.report["diagnosis"][0]["cause"] if g.report.get("diagnosis") else None}
    want = {"replay": {"status": "in-process", "step": step},
            "step": step, "phase": "forward", "module": "head", "op": "aten.log",
            "source": f"{SCRIPTS / LATE}:{script_line(LATE, 'torch.log(prior)')}",
            "micro_batch": 0, "cause": "log_of_nonpositive"}
    assert got == want, g.explain()
    assert g.report["status"] == "failed" and g.proc.returncode == 1


def test_in_process_replay_leaves_training_bitwise_identical(tmp_path: Path) -> None:
    """Observe is non-invasive through the recording and the replay: with `--sanitize-grads`
    the failing step (300) changes nothing but momentum and training goes on for 60 finite
    steps (fresh random batches, dropout); the parameters at the end are bitwise those of the
    script run alone."""
    args = ("--steps", "360", "--anneal-steps", "300", "--sanitize-grads", "--save")
    (tmp_path / "alone").mkdir()
    r = plain(tmp_path / "alone", LATE, *args, "params.pt")
    assert r.returncode == 0, r.stderr
    g = guarded(tmp_path, LATE, *args, str(tmp_path / "guarded.pt"))
    assert g.report["run"].get("replay") == {"status": "in-process", "step": 300}, g.explain()
    assert (g.first["step"], g.first["op"]) == (300, "aten.log"), g.explain()
    alone = torch.load(tmp_path / "alone" / "params.pt")
    watched = torch.load(tmp_path / "guarded.pt")
    assert alone.keys() == watched.keys()
    assert all(torch.isfinite(t).all() for t in alone.values())
    different = [k for k in alone if not torch.equal(alone[k], watched[k])]
    assert different == []


def test_loss_not_replayable_in_process_gets_its_origin_from_the_rerun(tmp_path: Path) -> None:
    """A hand-written masked mean (`(per_token * mask).sum() / mask.sum()`) is not a loss the
    recorder can compute again: the in-process replay says why, and the re-run of the script
    pinpoints the 0 / 0 of batch 25 at the division of the loss line, phase `loss`."""
    name = "masked_tokens.py"
    traced, g = both(tmp_path, name, "--steps", "30", "--empty-step", "25")
    assert traced.first == {"step": 25, "phase": "loss"}, traced
    first = g.first
    replay = g.report["run"]["replay"]
    got = {"status": g.report["status"], "exit": g.proc.returncode,
           "replay": replay["status"], "step": first["step"], "phase": first["phase"],
           "op": first["op"], "source": first["source"],
           "cause": g.causes[0] if g.causes else None}
    line = script_line(name, "loss = (per_token * mask).sum() / mask.sum()")
    want = {"status": "failed", "exit": 1, "replay": "found", "step": 25, "phase": "loss",
            "op": "aten.div", "source": f"{SCRIPTS / name}:{line}", "cause": "division_by_zero"}
    assert got == want, g.explain()
    assert "is not a torch.nn.functional loss" in replay["in_process"], replay
