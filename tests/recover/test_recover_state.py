"""Recovery state survives a round trip.

- `Guard.state_dict()` taken mid-run, through JSON, into a fresh guard on the same model and
  optimizer: the later decisions (which snapshot a rollback restores, the compounded backoff
  factor from the rollback history, clip / keep from the clipper's mean / var / count, amp_skip
  and amp_collapse from the scaler watch's last scale and back-off count) are those of the
  uninterrupted guard, and the runs end bitwise equal. A fresh guard without the state decides
  differently (so the test can tell).
- `HostSnapshot.capture` / `restore` is bitwise for parameters, buffers, the full optimizer
  state_dict, a LambdaLR, a GradScaler and the RNG, in place (the same tensor objects), and can
  be restored more than once.
"""

from __future__ import annotations

import copy
import json

import torch
from recover_helpers import (
    assert_same,
    assert_same_training,
    make_batches,
    make_model,
    make_optimizer,
    poison,
    quiet,
)

from nanguard import Guard
from nanguard.config import AmpConfig, ClipConfig, RecoverConfig
from nanguard.recover import HostSnapshot

SPLIT = 15


def _rollback_cfg():
    return quiet(
        "rollback",
        recover=RecoverConfig(snapshot_every=5, quiet_steps=3, backoff_steps=6),
        clip=ClipConfig(warmup_steps=5),
        act_on=("nonfinite",),  # the clipper, not the spike detector, handles step 22's spike
    )


def _rollback_batches():
    out = make_batches(30)
    out[7] = poison(out[7])  # rollback to 5 (next quiet snapshot: 15)
    out[17] = poison(out[17])  # rollback to 15, LR x0.5 (a repeat: compounded with x1)
    out[22] = (out[22][0], out[22][1] * 30)  # a spike: clipped once the clipper is warm
    return out


def _train_rollback(split: int | None, carry: bool = True):
    model = make_model(0, bn_dropout=True)
    opt = make_optimizer("adam", model)
    guard = Guard(model, opt, config=_rollback_cfg())
    for i, (x, y) in enumerate(_rollback_batches()):
        if i == split:
            state = json.loads(json.dumps(guard.state_dict()))
            guard.close()
            guard = Guard(model, opt, config=_rollback_cfg())
            if carry:
                guard.load_state_dict(state)
        loss = torch.nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()
    return model, opt, guard


def _decisions(guard):
    return [(a["step"], a["action"], a["detail"]) for a in guard.actions]


def test_rollback_and_clip_state_round_trip():
    model_a, opt_a, whole = _train_rollback(None)
    model_b, opt_b, resumed = _train_rollback(SPLIT)
    acted = {(s, a) for s, a, _ in _decisions(whole)}
    assert {(7, "rollback"), (17, "rollback"), (22, "clip")} <= acted, _decisions(whole)
    assert (
        "restored the state of step 15,"
        in dict(((s, a), d) for s, a, d in _decisions(whole))[(17, "rollback")]
    )
    # A NaN batch keeps the LR (the data, not the LR); the repeat within the window compounds.
    assert "LR kept: the batch itself held" in [d for s, a, d in _decisions(whole) if s == 7][0]
    assert "LR x0.5 " in [d for s, a, d in _decisions(whole) if s == 17][0]

    assert _decisions(resumed) == _decisions(whole)
    assert_same([a.to_dict() for a in resumed.alarms], [a.to_dict() for a in whole.alarms])
    assert resumed.recovery.state_dict() == whole.recovery.state_dict()
    assert_same_training(model_a, opt_a, model_b, opt_b)

    # Without the state, the fresh guard decides otherwise (LR kept, a cold clipper).
    _, _, amnesiac = _train_rollback(SPLIT, carry=False)
    assert _decisions(amnesiac) != _decisions(whole)


def _train_amp(split: int | None, carry: bool = True):
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    cfg = quiet("observe", amp=AmpConfig(max_halvings=2))

    def make():
        return Guard(model, opt, scaler=scaler, config=cfg)

    guard = make()
    for i, (x, y) in enumerate(make_batches(25)):
        if i == split:
            state = json.loads(json.dumps(guard.state_dict()))
            guard.close()
            guard = make()
            if carry:
                guard.load_state_dict(state)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if i in (8, SPLIT):  # overflows: one before the split, one right at it
            loss = loss * float("inf")
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    guard.close()
    return guard


def test_scaler_watch_state_round_trip():
    whole = _train_amp(None)
    resumed = _train_amp(SPLIT)
    kinds = [(a["action"], a["detail"]) for a in whole.actions]
    assert [k for k, _ in kinds] == ["amp_skip", "amp_skip"]
    collapses = [a.to_dict() for a in whole.alarms if a.kind == "amp_collapse"]
    assert len(collapses) == 1  # the 2nd back-off in a row (max_halvings=2)
    assert resumed.actions == whole.actions
    assert_same([a.to_dict() for a in resumed.alarms], [a.to_dict() for a in whole.alarms])
    assert resumed.recovery.amp.state_dict() == whole.recovery.amp.state_dict()

    # A fresh guard without the state has no last scale: the skip at the split goes unseen,
    # and so does the collapse.
    amnesiac = _train_amp(SPLIT, carry=False)
    assert amnesiac.actions == [] and amnesiac.alarms == []


def test_host_snapshot_round_trip_is_bitwise():
    model = make_model(3, bn_dropout=True)
    opt = make_optimizer("adam", model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.9**t)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    snap = HostSnapshot(model, opt, extras={"scheduler": sched, "scaler": scaler})
    batches = make_batches(12, seed=3)

    def run(part):
        for x, y in part:
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sched.step()

    def state():
        return copy.deepcopy(
            (
                model.state_dict(),
                opt.state_dict(),
                sched.state_dict(),
                scaler.state_dict(),
                torch.get_rng_state(),
            )
        )

    run(batches[:5])
    snap.capture(5)
    at5 = state()
    live = [id(t) for t in list(model.parameters()) + list(model.buffers())]
    live += [id(v) for s in opt.state.values() for v in s.values()]
    run(batches[5:])
    assert scaler.get_scale() != at5[3]["scale"] and sched.last_epoch != at5[2]["last_epoch"]
    for _ in range(2):  # restore twice: the host copy is not consumed
        assert snap.restore() == 5
        assert_same(state(), at5, "snapshot")
        now = [id(t) for t in list(model.parameters()) + list(model.buffers())]
        now += [id(v) for s in opt.state.values() for v in s.values()]
        assert now == live, "restore must write into the live tensors"
        run(batches[5:7])

    # A capture before any step (no optimizer state yet): restoring it drops the state.
    model = make_model(3, bn_dropout=True)
    opt = make_optimizer("adam", model)
    snap = HostSnapshot(model, opt)
    snap.capture(0, in_step=False)
    fresh = copy.deepcopy((model.state_dict(), opt.state_dict()))
    for x, y in batches[:3]:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    assert opt.state
    assert snap.restore() == 0
    assert_same((model.state_dict(), opt.state_dict()), fresh, "initial")
