"""The `heal` policy (`nanguard.recover.heal`) on real tiny training.

- A planted precursor (one step's gradients scaled 40x after backward while its batch's loss
  stays at its level: the signature of an unstable optimizer) under SGD: in the plain run the
  update of that step makes the next loss jump (checked on the plain run itself, without
  nanguard); under `heal` the step is clipped before its update (action `heal_clip` at that
  step, with the ratio to the rolling mean that triggered it), the next loss stays at its level,
  and no step is lost.
- A healthy run: zero actions, zero alarms, `heal` leaves it bitwise as plain training.
- Recurring precursors under AdamW with weight decay while the weights shrink (their norm
  measured by the test, not by nanguard): the weight decay is cut and `run.recovery.heal.cause`
  names LR x weight decay with the run's own lr, weight decay and weight norms; without weight
  decay the LR is cut instead.
- Recurring *bad batches* (batches scaled 40x: their own loss is the outlier, before any
  update): each is clipped and named, and neither the LR nor the weight decay is cut
  (issue 40: the data is the cause).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from recover_helpers import make_batches, make_model, quiet
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.config import HealConfig
from nanguard.record.report import report_schema
from nanguard.show.summary import heal_line

K = 120  # the planted step (past the 50 warm-up steps of the statistics)


def _jump(model: nn.Module) -> None:
    """A precursor as an unstable optimizer makes it: the gradients jump 40x while the batch
    (and its loss) is an ordinary one."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(40)


def _run(batches, *, guard_policy: str | None, opt_kind: str = "sgd", wd: float = 0.0,
         planted: tuple[int, ...] = (K,), out=None, norms: list[float] | None = None,
         bad_batches: bool = False):
    model = make_model(0)
    if opt_kind == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=wd)
    guard = None
    if guard_policy is not None:
        cfg = (GuardConfig(policy=guard_policy, record=RecordConfig(out=str(out), summary=False))
               if out is not None else quiet(guard_policy))
        guard = Guard(model, opt, config=cfg)
    losses = []
    for i, (x, y) in enumerate(batches):
        if i in planted and bad_batches:
            x, y = x * 40, y * 40
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        if i in planted and not bad_batches:
            _jump(model)
        opt.step()
        losses.append(loss.item())
        if norms is not None:
            with torch.no_grad():
                norms.append(float(torch.linalg.vector_norm(
                    torch.stack([p.norm() for p in model.parameters()]))))
    report = guard.close() if guard is not None else None
    return model, losses, report


def test_acts_on_the_precursor_before_the_loss_spike():
    batches = make_batches(K + 20)
    _, plain, _ = _run(batches, guard_policy=None)
    # Established on the plain run alone: the planted step's update makes the next loss jump.
    before = sum(plain[K - 10:K]) / 10
    assert plain[K + 1] > 5 * before
    _, healed, report = _run(batches, guard_policy="heal")
    clips = [a for a in report.actions if a["action"] == "heal_clip"]
    assert [a["step"] for a in clips] == [K]
    m = re.search(r"grad norm \S+ is ([\d.]+)x its rolling mean", clips[0]["detail"])
    assert m and float(m.group(1)) > 10  # the why: 40x batch, a grad norm far above typical
    assert healed[K + 1] < 2 * before  # no loss spike after the clipped update
    assert healed[: K + 1] == plain[: K + 1]  # nothing changed before it
    heal = report.run["recovery"]["heal"]
    assert heal["updates_clipped"] == 1 and heal["steps_lost"] == 0
    assert re.fullmatch(r"heal: 1 spike precursor\(s\) clipped, 0 cut\(s\), 0 step\(s\) lost, "
                        r"[\d.e-]+ ms acting", heal_line(report)), heal_line(report)
    assert 0 < report.run["recovery"]["heal"]["seconds"] < 1.0  # one foreach multiply


def test_healthy_run_no_action_and_bitwise_plain():
    batches = make_batches(300, seed=3)
    plain_model, plain, _ = _run(batches, guard_policy=None, opt_kind="adam", planted=())
    model, healed, report = _run(batches, guard_policy="heal", opt_kind="adam", planted=())
    assert report.actions == [] and report.alarms == []
    assert healed == plain
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "recovery" not in report.run


def test_cause_lr_times_weight_decay_named_with_the_runs_numbers(tmp_path):
    batches = make_batches(400, seed=1)
    norms: list[float] = []
    planted = (150, 250)
    _, _, report = _run(batches, guard_policy="heal", opt_kind="adamw", wd=2.0,
                        planted=planted, out=tmp_path, norms=norms)
    # Independent of nanguard: the weights shrank under weight decay before the cut.
    assert norms[249] < 0.8 * norms[9]
    cuts = [a for a in report.actions if a["action"] in ("wd_cut", "lr_cut")]
    assert [a["action"] for a in cuts] == ["wd_cut"] and cuts[0]["step"] == 250
    heal = report.run["recovery"]["heal"]
    assert heal["cuts"][0]["weight_decay"] == 2.0 and heal["weight_decay_factor"] == 0.5
    cause = heal["cause"]
    assert "LR x weight decay" in cause and "lr 0.01 x weight_decay 2 = 0.02" in cause
    m = re.search(r"weight norm fell from ([\d.]+) \(step (\d+)\) to ([\d.]+) \(step (\d+)\)",
                  cause)
    assert m is not None
    for value, step in ((float(m.group(1)), int(m.group(2))), (float(m.group(3)),
                                                                int(m.group(4)))):
        assert abs(value - norms[step]) < 1e-3 * norms[step]  # the run's own numbers
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["run"]["recovery"]["heal"]["cause"] == cause
    jsonschema = pytest.importorskip("jsonschema")
    assert not list(jsonschema.Draft202012Validator(report_schema()).iter_errors(on_disk))
    assert heal_line(report).endswith(f"what drove the spikes: {cause}")
    # The same precursors without weight decay: the LR is what is cut.
    _, _, report = _run(batches, guard_policy="heal", opt_kind="adamw", wd=0.0,
                        planted=planted)
    assert [a["action"] for a in report.actions if a["action"].endswith("_cut")] == ["lr_cut"]
    assert report.run["recovery"]["heal"]["lr_factor"] == 0.5


def test_heal_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="heal.correct"):
        GuardConfig(policy="heal", heal=HealConfig(correct="sometimes"))
    with pytest.raises(ValueError, match="cut_factor"):
        GuardConfig(policy="heal", heal=HealConfig(cut_factor=1.5))


def test_heal_state_survives_a_resume():
    batches = make_batches(260, seed=1)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    guard = Guard(model, opt, config=quiet("heal"))
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        if i in (150, 250):
            _jump(model)
        opt.step()
    state = guard.state_dict()
    before = guard.recovery.healer.state_dict()
    guard.close()
    assert before["lr_factor"] == 0.5 and before["total"] == 2
    resumed = Guard(model, opt, config=quiet("heal"))
    resumed.load_state_dict(state)
    assert resumed.recovery.healer.state_dict() == before
    resumed.close()


@pytest.mark.parametrize(("correct", "cut"), [("auto", "lr_cut"), ("wd", "wd_cut"),
                                              ("lr", "lr_cut"), ("none", None)])
def test_correct_setting_picks_the_cut(correct, cut):
    # Weight decay 0.01 barely moves the weights: no evidence for LR x WD, so `auto` cuts the
    # LR; `wd` cuts the weight decay as configured; `none` only clips.
    batches = make_batches(260, seed=1)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    guard = Guard(model, opt, config=GuardConfig(
        policy="heal", record=RecordConfig(out="", summary=False),
        heal=HealConfig(correct=correct)))
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        if i in (150, 250):
            _jump(model)
        opt.step()
    report = guard.close()
    cuts = [a["action"] for a in report.actions if a["action"].endswith("_cut")]
    assert cuts == ([cut] if cut else [])
    assert sum(a["action"] == "heal_clip" for a in report.actions) == 2
    assert opt.param_groups[0]["weight_decay"] == (0.005 if cut == "wd_cut" else 0.01)


def test_bad_batches_clipped_and_named_no_cut():
    # The same AdamW with weight decay whose recurring precursors earn a cut above, but the
    # jumps come from the batches themselves (scaled 40x: their own loss is the outlier).
    batches = make_batches(400, seed=1)
    planted = (150, 250, 330)
    _, plain, _ = _run(batches, guard_policy=None, opt_kind="adamw", wd=2.0, planted=planted,
                       bad_batches=True)
    # Independent of nanguard: each planted batch's own loss stands far above the step before.
    assert all(plain[k] > 20 * plain[k - 1] for k in planted)
    _, _, report = _run(batches, guard_policy="heal", opt_kind="adamw", wd=2.0,
                        planted=planted, bad_batches=True)
    assert not [a for a in report.actions if a["action"].endswith("_cut")]
    clips = [a for a in report.actions if a["action"] == "heal_clip"]
    assert [a["step"] for a in clips] == list(planted)
    assert all("a bad batch (batch " in a["detail"] and "no LR or weight decay cut" in a["detail"]
               for a in clips)
    heal = report.run["recovery"]["heal"]
    assert heal["bad_batches"] == list(planted) and heal["precursors"] == 0
    assert heal["lr_factor"] == 1.0 and heal["weight_decay_factor"] == 1.0
    named = [(a["step"], a["signal"]) for a in report.alarms if a.get("cause") == "bad_batch"]
    assert {s for s, _ in named} == set(planted)
    assert report.status != "healthy"


def test_a_cut_below_every_alarm_is_said_live_and_the_run_is_not_healthy(caplog):
    # Grad-norm jumps of 6x (two steps, a batch of ordinary loss): above heal's precursor bar
    # (3x and 6 sigma) but below every alarm's threshold, so heal clips and cuts the LR with no
    # alarm raised. The training was changed: the status must say so, and the cut must reach
    # the person as it happens, with the steps that earned it (issue 40: a status never lies).
    caplog.set_level("WARNING", logger="nanguard")
    batches = make_batches(300, seed=1)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    guard = Guard(model, opt, config=quiet("heal"))
    lrs: list[float] = []  # the LR each update used, read by the test (its hook runs after
    opt.register_step_pre_hook(lambda o, a, k: lrs.append(o.param_groups[0]["lr"]))  # heal's)
    ratios = {}  # the planted steps' grad norm against the mean of the 50 before, measured here
    norms: list[float] = []
    for i, (x, y) in enumerate(batches):
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        if i in (150, 250):
            for p in model.parameters():
                p.grad.mul_(6)
        norms.append(float(torch.linalg.vector_norm(torch.stack(
            [p.grad.norm() for p in model.parameters()]))))
        if i in (150, 250):
            ratios[i] = norms[-1] / (sum(norms[-51:-1]) / 50)
        opt.step()
    report = guard.close()
    assert all(r > 3 for r in ratios.values()), ratios  # a jump, established without nanguard
    assert report.alarms == []  # below every alarm: nothing else would have said a word
    cuts = [a for a in report.actions if a["action"] == "lr_cut"]
    assert [a["step"] for a in cuts] == [250]
    # The cut is real: every update from step 250 on ran at half the scheduler's LR.
    assert lrs[249] == 1e-2 and lrs[250:] == [5e-3] * 50
    assert report.status == "recovered"  # changed by the guard: never `healthy`
    said = [r.getMessage() for r in caplog.records if "action lr_cut" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("step 250 action lr_cut: LR x0.5")
    m = re.search(r"2 grad-norm spikes within 100 steps \(steps 150 \(([\d.]+)x its rolling "
                  r"mean\), 250 \(([\d.]+)x\)\)", said[0])
    assert m is not None, said[0]  # the evidence: which steps, how far out
    for got, step in ((float(m.group(1)), 150), (float(m.group(2)), 250)):
        assert abs(got - ratios[step]) < 0.25 * ratios[step]  # the run's own numbers
