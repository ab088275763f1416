"""The run log: plain data that explain reads, and that a Guard's state_dict carries."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.explain import diagnose
from nanguard.explain.context import evidence_from_log


def _guard(model: nn.Module, opt: torch.optim.Optimizer, out: Path) -> Guard:
    return Guard(model, opt, out=out, config=GuardConfig(record=RecordConfig(summary=False)))


def _step(guard: Guard, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    loss = model(x).pow(2).mean()
    loss.backward()
    guard.watch(loss=loss, batch=x)
    opt.step()
    opt.zero_grad()


def test_run_log_is_plain_data_and_explains_without_the_guard(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = _guard(model, opt, tmp_path / "a")
    for k in range(6):
        x = torch.randn(8, 4)
        if k == 4:
            x[2, 1] = math.nan
        _step(guard, model, opt, x)
    log = guard.run_log()
    guard.close()
    text = json.dumps(log)  # plain data: JSON (NaN kept as NaN)
    back = json.loads(text)
    assert back["optimizer"] == {"name": "SGD", "lr": 0.05, "momentum": 0.9, "eps": None,
                                 "dtype": "torch.float32"}
    assert back["failing"]["step"] == 4 and back["failing"]["bad_tensors"] == [0]
    assert [r["step"] for r in back["history"]][:5] == [0, 1, 2, 3, 4]
    causes = diagnose(evidence_from_log(back))
    assert causes and causes[0].cause == "data_nonfinite"
    assert causes[0].cause == guard.report.diagnosis[0]["cause"]  # type: ignore[union-attr]


def test_a_resumed_guard_keeps_the_history_from_before_the_resume(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = _guard(model, opt, tmp_path / "a")
    for _ in range(5):
        _step(first, model, opt, torch.randn(8, 4))
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint would carry it
    first.close()
    second = _guard(model, opt, tmp_path / "b")
    second.load_state_dict(state)
    _step(second, model, opt, torch.randn(8, 4))
    steps = [r["step"] for r in second.run_log()["history"]]
    second.close()
    assert steps == [0, 1, 2, 3, 4, 5]
