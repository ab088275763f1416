"""LR jumps and resumes without warm-up (issue 40 items 2 and 3), on a small character LM
(scripts/lr_jump_lm.py: AdamW, a schedule from flags, checkpoints saved and resumed).

- The schedule jumps 10x at a flag-chosen step. Established on the plain run alone: the loss
  after the jump climbs to several times its level before. Under `observe` the jump is an
  `lr_jump` alarm with its step, old and new LR and factor, said live; the loss after it is an
  `lr_jump_loss` alarm; the diagnosis names the jump (`lr_jump`) with a warm-up from the old
  LR as the fix; training is bitwise the plain run's.
- Under `heal` the LR is ramped back up from the pre-jump value (run.db: the LR the update at
  the jump used is the old one), no LR or weight-decay cut, and the loss after the jump stays
  below the plain run's.
- The same jump reached by a warm-up is no jump: no alarm.
- A resume: train, save a checkpoint with the guard's state, resume at 10x the LR with no
  warm-up. The resumed run reproduces the uninterrupted one bit for bit (so the spike is the
  one the plain run shows); the jump at the resume's first step is named "at the resume", the
  loss right after the resume is a `resume_loss` alarm with the loss at save, and the
  diagnosis names the jump. `heal` resumed from a state saved under `heal` acts from the first
  step (its statistics came with the state: no 50-step wait).
- Zero code: `nanguard run` on the resumed script (no guard state in the checkpoint) sees the
  jump at its first step against the LR the loaded optimizer state carried, and the loss
  after it against the loss of that first step.
"""

from __future__ import annotations

import importlib.util
import json
import sqlite3
import statistics
from pathlib import Path

import pytest

from helpers import run_python

SCRIPT = Path(__file__).parent / "scripts" / "lr_jump_lm.py"
J = 100  # the step the schedule jumps at (and the resume point)
STEPS = 140
LR = 3e-3

_spec = importlib.util.spec_from_file_location("lr_jump_lm", SCRIPT)
assert _spec is not None and _spec.loader is not None
lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lm)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _lr_of(out: Path, step: int) -> float:
    with sqlite3.connect(out / "run.db") as db:
        return float(db.execute("select lr from steps where step = ?", (step,)).fetchone()[0])


def _jump_args(*extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--jump_at", str(J), "--lr", str(LR), *extra]


@pytest.fixture(scope="module")
def plain() -> list[float]:
    losses = lm.main(_jump_args())
    before = statistics.median(losses[J - 16:J])
    # The planted fault, checked on the plain run itself: the loss climbs after the jump.
    assert max(losses[J:J + 30]) > 3 * before
    return losses


def test_the_jump_is_an_event_and_named_as_the_cause(plain, tmp_path, caplog):
    caplog.set_level("WARNING", logger="nanguard")
    losses = lm.main(_jump_args("--guard", "observe", "--out", str(tmp_path)))
    assert losses == plain  # observing never changes training
    report = _report(tmp_path)
    jumps = [a for a in report["alarms"] if a["kind"] == "lr_jump"]
    assert [(a["step"], a["signal"], a["value"]) for a in jumps] == [(J, "lr", 10.0)]
    assert "the LR went 10x at step 100 (0.003 -> 0.03) without warm-up" in jumps[0]["message"]
    after = [a for a in report["alarms"] if a["kind"] == "lr_jump_loss"]
    assert len(after) == 1 and J < after[0]["step"] <= J + 50 and after[0]["value"] > 2
    assert report["status"] == "warned"
    # Said live, as it happened.
    said = [r.getMessage() for r in caplog.records]
    assert any("lr_jump" in m and "10x at step 100" in m for m in said), said
    cause = report["diagnosis"][0]
    assert cause["cause"] == "lr_jump"
    assert cause["evidence"].startswith("The LR went 10x at step 100 (0.003 -> 0.03)")
    assert "warm the LR up from 0.003 to 0.03" in cause["fix"]


def test_heal_ramps_the_lr_back_up_instead_of_cutting_it(plain, tmp_path):
    losses = lm.main(_jump_args("--guard", "heal", "--out", str(tmp_path)))
    assert losses[:J + 1] == plain[:J + 1]  # nothing changed before the jump's update
    report = _report(tmp_path)
    acts = [a["action"] for a in report["actions"]]
    assert "lr_ramp" in acts and "lr_cut" not in acts and "wd_cut" not in acts, acts
    ramp = next(a for a in report["actions"] if a["action"] == "lr_ramp")
    assert ramp["step"] == J and "ramped back up from 0.003" in ramp["detail"]
    heal = report["run"]["recovery"]["heal"]
    assert heal["lr_ramps"] == [{"step": J, "old_lr": LR, "new_lr": 10 * LR, "factor": 10.0,
                                 "steps": 100}]
    assert heal["lr_factor"] == 1.0
    # The updates used the ramp: the old LR at the jump, halfway up 50 steps later.
    assert _lr_of(tmp_path, J) == pytest.approx(LR)
    assert _lr_of(tmp_path, J + 20) == pytest.approx(LR + 0.2 * 9 * LR)
    assert max(losses[J:]) < 0.6 * max(plain[J:])
    assert statistics.mean(losses[J:]) < 0.7 * statistics.mean(plain[J:])


def test_a_warm_up_to_the_same_lr_is_no_jump(tmp_path):
    lm.main(_jump_args("--warmup", "30", "--guard", "observe", "--out", str(tmp_path)))
    report = _report(tmp_path)
    kinds = {a["kind"] for a in report["alarms"]}
    assert not kinds & {"lr_jump", "lr_jump_loss"}, report["alarms"]
    assert all(d["cause"] != "lr_jump" for d in report["diagnosis"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The first J steps under `heal` (nothing to act on: bitwise plain), saved with the
    guard's state at step J."""
    folder = tmp_path_factory.mktemp("ckpt")
    lm.main(["--steps", str(J), "--lr", str(LR), "--guard", "heal", "--out",
             str(folder / "first"), "--save", str(folder / "ckpt.pt")])
    return folder / "ckpt.pt"


def test_a_resume_at_10x_the_lr_is_judged_from_the_saved_run(plain, checkpoint, tmp_path):
    resumed = lm.main(["--steps", "30", "--lr", str(10 * LR), "--resume", str(checkpoint),
                       "--guard", "observe", "--out", str(tmp_path)])
    # The resume reproduces the uninterrupted run (whose schedule jumped at the same step).
    assert resumed == plain[J:J + 30]
    report = _report(tmp_path)
    jump = next(a for a in report["alarms"] if a["kind"] == "lr_jump")
    assert jump["step"] == J and jump["value"] == 10.0
    assert "the LR went 10x at the resume, step 100 (0.003 -> 0.03)" in jump["message"]
    at_save = statistics.median(plain[J - 16:J])
    found = [a for a in report["alarms"] if a["kind"] == "resume_loss"]
    assert len(found) == 1 and J < found[0]["step"] <= J + 11, report["alarms"]
    assert f"the loss recorded at save ({at_save:.4g}" in found[0]["message"]
    assert found[0]["value"] > 2
    assert report["diagnosis"][0]["cause"] == "lr_jump"
    assert "after the resume" in report["diagnosis"][0]["fix"]


def test_heal_resumed_acts_from_the_first_step(plain, checkpoint, tmp_path):
    state = lm.torch.load(checkpoint, weights_only=True)["guard"]
    assert state["recovery"]["heal"]["count"] >= J  # its statistics travel with the state
    resumed = lm.main(["--steps", "30", "--lr", str(10 * LR), "--resume", str(checkpoint),
                       "--guard", "heal", "--out", str(tmp_path)])
    report = _report(tmp_path)
    assert [(a["step"], a["action"]) for a in report["actions"]][:1] == [(J, "lr_ramp")]
    assert _lr_of(tmp_path, J) == pytest.approx(LR)
    assert max(resumed) < 0.6 * max(plain[J:J + 30])


def test_nanguard_run_sees_a_resume_jump_at_its_first_step(checkpoint, tmp_path):
    cp = run_python(tmp_path, "-m", "nanguard", "run", "--out", str(tmp_path / "run"),
                    str(SCRIPT), "--steps", "12", "--lr", str(10 * LR), "--resume",
                    str(checkpoint))
    assert cp.returncode == 0, cp.stderr
    losses = [float(line.split()[3]) for line in cp.stdout.splitlines()
              if line.startswith("step ")]
    report = _report(tmp_path / "run")
    jump = next(a for a in report["alarms"] if a["kind"] == "lr_jump")
    assert jump["step"] == 0 and "10x at the resume, step 0 (0.003 -> 0.03)" in jump["message"]
    assert "lr_jump" in cp.stderr
    # No history before the resume: the level is the loss of its first step (its forward ran
    # on the restored weights), and the spike after it is measured against that.
    rose = next(a for a in report["alarms"] if a["kind"] == "lr_jump_loss")
    assert f"({losses[0]:.4g}, the loss of step 0, before any update" in rose["message"]
    assert report["diagnosis"][0]["cause"] == "lr_jump"
    assert "`nanguard run --policy heal`" in report["diagnosis"][0]["fix"]


def test_a_resume_at_the_same_lr_is_quiet(plain, checkpoint, tmp_path):
    resumed = lm.main(["--steps", "15", "--lr", str(LR), "--resume", str(checkpoint),
                       "--guard", "observe", "--out", str(tmp_path)])
    assert max(resumed) < 2 * statistics.median(plain[J - 16:J])  # the plain truth: no spike
    kinds = {a["kind"] for a in _report(tmp_path)["alarms"]}
    assert not kinds & {"lr_jump", "lr_jump_loss", "resume_loss"}, kinds


def test_lr_and_heal_ramp_state_round_trip():
    from nanguard.config import HealConfig
    from nanguard.policy.lr_change import LrChanges
    from nanguard.recover.heal import Healer
    from nanguard.recover.loss_after import LossAfter, loss_level

    a = LrChanges()
    a.see(0, 1e-3)
    jump = a.see(40, 1e-2)  # 40 steps in: trained past one step at the new LR (no warm-up)
    assert jump is not None and jump.factor == pytest.approx(10) and not jump.resumed
    b = LrChanges()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert (b.last, b.jumps, b.jump) == (a.last, a.jumps, a.jump)
    assert b.see(41, 3e-2) is not None and b.jump is not None and b.jump.resumed  # from a save

    class _Opt:
        param_groups = [{"lr": 1e-2}]

    class _Link:
        optimizer = _Opt()

    h = Healer(HealConfig(), _Link(), a)
    h._start_ramp(jump)
    h2 = Healer(HealConfig(), _Link())
    h2.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert h2.ramp == h.ramp and h2.ramps == h.ramps
    assert h2._ramp_factor(40 + 50) == pytest.approx(0.1 + 0.9 * 0.5)

    level = loss_level([1.0, 1.1, 0.9, None, float("nan"), 1.0])
    assert level == {"median": 1.0, "mad": pytest.approx(0.05), "n": 4.0}
    check = LossAfter.resumed({"loss": level}, 10)
    assert check is not None
    assert check.see(10, 5.0, None) is None  # far above: waits for the next step
    assert check.see(11, 1.0, None) is None  # back down: a bad batch, not the resume
    assert check.see(12, 5.0, None) is None and check.see(13, 4.0, None) is not None


def test_heal_resumed_from_a_state_saved_under_another_policy_starts_warm(checkpoint):
    from nanguard import Guard, GuardConfig, RecordConfig

    state = lm.torch.load(checkpoint, weights_only=True)["guard"]
    state["recovery"]["heal"] = None  # as a guard under `observe` saves it
    norms = [h["grad_norm"] for h in state["log"]["history"]]
    model = lm.CharLM(32)
    guard = Guard(model, lm.torch.optim.AdamW(model.parameters()), config=GuardConfig(
        policy="heal", record=RecordConfig(out="", summary=False)))
    guard.load_state_dict(state)
    healer = guard.recovery.healer
    assert healer is not None and healer.count == len(norms) >= 50  # past its 50-step warm-up
    assert min(norms) < healer.mean < max(norms)
    guard.close()


def test_a_cut_soon_after_the_ramp_names_the_jump():
    """Precursors that recur right after the ramp ends: the target LR itself is unstable. The
    cut is made (the ramp is over), and its cause names the jump, not only the LR."""
    from nanguard.config import HealConfig
    from nanguard.policy.lr_change import Jump
    from nanguard.recover.heal import Healer

    class _Opt:
        param_groups = [{"lr": 0.1, "weight_decay": 0.0}]

    class _Link:
        optimizer = _Opt()

    h = Healer(HealConfig(), _Link())
    h._start_ramp(Jump(300, 0.01, 0.1))
    assert h._ramp_factor(400) == 1.0 and h.ramp is None  # the ramp is over at step 400
    h.precursors.extend([404, 405])
    h._correct(405)
    assert [c["action"] for c in h.cuts] == ["lr_cut"] and h.lr_factor == 0.5
    assert h.cause == ("the LR: lr 0.1, the LR the jump at step 300 went to (0.01 -> 0.1), at "
                       "its full value for 6 step(s) after a 100-step ramp; 2 grad-norm spikes "
                       "within 1 steps (steps 404, 405)")
    # Long after the ramp, a cut is about the LR alone.
    h.precursors.extend([900, 901])
    h._correct(901)
    assert h.cause is not None and "jump" not in h.cause
