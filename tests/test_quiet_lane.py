"""The quiet lane (`watch.lane`) on real training: the same statistics, alarms, report.json and
run.db as the packet path, and the same weights as training without a guard.

Each run trains a tiny CPU model twice from the same seed under `observe`, once with the lane
(the default) and once with it off (`WatchConfig(quiet_lane=False)`: every step through
`StepWatch`'s packets), and compares every recorded step's `StepStats` field by field, the
detectors' state, the alarms, and everything the run leaves behind except the folder, the
wall-clock time of each step row and the process metadata (`test_quiet_gate_runs._leftovers`).
The runs cover healthy training (SGD with momentum, AdamW with a schedule, a CNN with
BatchNorm buffers), the LR/momentum cascade, a gradient spike, a NaN row in the data,
micro-batches and an optimizer group added mid-run.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanguard
from helpers import make_cnn, make_mlp, train, warmup_cosine
from nanguard import GuardConfig, RecordConfig, WatchConfig
from nanguard.errors import NanguardError
from nanguard.scenarios.cascade import train_cascade
from nanguard.watch.lane import LaneStep
from test_quiet_gate_runs import assert_same_runs


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN weights too)."""
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _guard(model: nn.Module, opt: torch.optim.Optimizer, out: Path, lane: bool,
           policy: str = "observe") -> nanguard.Guard:
    return nanguard.Guard(model, opt, config=GuardConfig(
        policy=policy, record=RecordConfig(out=str(out), summary=False),
        watch=WatchConfig(quiet_lane=lane)))


def _mlp_run(out: Path, lane: bool, *, opt_kind: str, steps: int, spike_at: int | None = None,
             nan_at: int | None = None, micro_at: int | None = None,
             group_at: int | None = None, policy: str = "observe", clip: float | None = None
             ) -> tuple[nanguard.Guard, list[torch.Tensor]]:
    task = make_mlp(3)
    model = task.model
    params = list(model.parameters())
    first, rest = params[:2], params[2:]
    opt: torch.optim.Optimizer
    if opt_kind == "sgd":
        opt = torch.optim.SGD(first if group_at else params, lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.AdamW(first if group_at else params, lr=3e-3)
    sched = None if group_at else warmup_cosine(opt, steps, warmup=10)
    g = _guard(model, opt, out, lane, policy)
    for step, (x, y) in enumerate(task.batches(steps)):
        if step == group_at:
            opt.add_param_group({"params": rest})
        if step == spike_at:
            x = x * 1e4
        if step == nan_at:
            x = x.clone()
            x[5, 2] = math.nan
        opt.zero_grad()
        parts = [(x[:11], y[:11]), (x[11:], y[11:])] if step == micro_at else [(x, y)]
        for i, (bx, by) in enumerate(parts):
            loss = task.loss_fn(model(bx), by)
            if i == 0:
                g.watch(loss=loss, batch=(bx, by))
            else:
                g.watch_micro_batch((bx, by))
            loss.backward()
        if clip is not None:  # the script's own clip, its total handed to the guard
            g.note_clip_norm(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        opt.step()
        if sched is not None:
            sched.step()
        if nan_at is not None and step > nan_at + 3:
            break
    g.close()
    return g, [p.detach().clone() for p in model.parameters()]


def _cnn_run(out: Path, lane: bool) -> tuple[nanguard.Guard, list[torch.Tensor]]:
    task = make_cnn(4)
    opt = torch.optim.SGD(task.model.parameters(), lr=0.05, momentum=0.9)
    g = _guard(task.model, opt, out, lane)
    train(task, opt, 40, guard=g)
    g.close()
    return g, [t.detach().clone() for t in task.model.state_dict().values()]


def _cascade_run(out: Path, lane: bool, policy: str = "observe"
                 ) -> tuple[nanguard.Guard, list[torch.Tensor]]:
    made: list[tuple[nanguard.Guard, nn.Module]] = []

    def factory(model: nn.Module, opt: torch.optim.Optimizer) -> nanguard.Guard:
        made.append((_guard(model, opt, out, lane, policy), model))
        return made[-1][0]

    with contextlib.suppress(NanguardError):  # `raise`: the report is written all the same
        train_cascade(8, factory, steps=150)
    g, model = made[0]
    return g, [p.detach().clone() for p in model.parameters()]


CASES: list[tuple[str, Callable[[Path, bool], tuple[nanguard.Guard, list[torch.Tensor]]]]] = [
    ("sgd-spike-micro-group", lambda o, lane: _mlp_run(
        o, lane, opt_kind="sgd", steps=90, spike_at=60, micro_at=30, group_at=45)),
    ("adamw-nan-row", lambda o, lane: _mlp_run(o, lane, opt_kind="adamw", steps=70, nan_at=50)),
    # The script clips below the usual norm: the spike is only in the total its clip measured.
    ("adamw-spike-clipped", lambda o, lane: _mlp_run(
        o, lane, opt_kind="adamw", steps=80, spike_at=60, clip=0.05)),
    ("cnn-buffers", _cnn_run),
    ("cascade", _cascade_run),
    # Acting policies read the pre-update part before the update (`QuietLane.read_pre`).
    ("cascade-heal", lambda o, lane: _cascade_run(o, lane, "heal")),
    ("cascade-rollback", lambda o, lane: _cascade_run(o, lane, "rollback")),
    ("cascade-raise", lambda o, lane: _cascade_run(o, lane, "raise")),
    ("adamw-nan-row-skip", lambda o, lane: _mlp_run(
        o, lane, opt_kind="adamw", steps=70, nan_at=50, policy="skip")),
]


@pytest.mark.parametrize("name,run", CASES, ids=[c[0] for c in CASES])
def test_lane_leaves_what_the_packet_path_leaves(tmp_path: Path, name: str, run: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[int] = []
    begin = nanguard.watch.lane.QuietLane.begin

    def counting(self: Any, step: int, *a: Any) -> LaneStep:
        taken.append(step)
        return begin(self, step, *a)

    monkeypatch.setattr(nanguard.watch.lane.QuietLane, "begin", counting)
    on, w_on = run(tmp_path / "on", True)
    lane_steps = list(taken)
    off, w_off = run(tmp_path / "off", False)
    assert len(taken) == len(lane_steps)  # the packet-path run took no step in the lane
    assert len(lane_steps) > 20  # the lane took steps: the comparison is not vacuous
    assert all(s % 10 for s in lane_steps) and 0 not in lane_steps  # update-norm, first step
    assert all(map(_same_bits, w_on, w_off))
    hist_on, hist_off = list(on.history), list(off.history)
    assert [s.step for s in hist_on] == [s.step for s in hist_off]
    for a, b in zip(hist_on, hist_off, strict=True):
        assert repr(a) == repr(b), a.step  # every field (NaN == NaN by repr)
    assert_same_runs(on, off, tmp_path / "on", tmp_path / "off")
    if name.endswith("clipped"):  # each step read its clip's total, on both paths
        assert all(s.clip_norm is not None and s.clip_norm > 0.05 for s in hist_on[:60])
    if name != "cnn-buffers":
        assert on.alarms  # spike, NaN row, cascade: both paths see them
    if name.endswith(("heal", "rollback", "skip")):
        assert on.actions and on.actions == off.actions  # the policy acted, the same way
    assert on.host_reads == off.host_reads


def test_lane_weights_equal_training_without_a_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Observing never changes training: the lane's run ends with the same bits as no guard."""
    taken: list[int] = []
    begin = nanguard.watch.lane.QuietLane.begin

    def counting(self: Any, step: int, *a: Any) -> LaneStep:
        taken.append(step)
        return begin(self, step, *a)

    monkeypatch.setattr(nanguard.watch.lane.QuietLane, "begin", counting)
    weights = []
    for guarded in (True, False):
        task = make_mlp(3)
        opt = torch.optim.SGD(task.model.parameters(), lr=0.05, momentum=0.9)
        g = nanguard.Guard(task.model, opt, out="") if guarded else None
        train(task, opt, 40, guard=g)
        if g is not None:
            g.close()
            assert g.config.policy == "observe" and len(taken) > 20  # the lane took them
        weights.append([p.detach().clone() for p in task.model.parameters()])
    assert all(map(_same_bits, *weights))
