"""The lazily folded gradient baseline is, bit for bit, the per-step EMA it replaces."""

from __future__ import annotations

import math
import random
import struct

import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig
from nanguard.pinpoint.baseline import GradBaseline


def _eager(steps: list[dict[int, float]]) -> dict[int, float]:
    """The per-step update the guard made before the baseline was folded lazily."""
    base: dict[int, float] = {}
    for d in steps:
        base.update({i: v if (prev := base.get(i)) is None else 0.9 * prev + 0.1 * v
                     for i, v in d.items()})
    return base


def _bits(d: dict[int, float]) -> dict[int, bytes]:
    return {k: struct.pack("<d", v) for k, v in d.items()}


def test_fold_equals_the_per_step_update() -> None:
    """Many parameters (NumPy runs), few (Python), parameters appearing late and missing on
    some steps, key order changing, tiny, huge and infinite norms; read at odd points."""
    rnd = random.Random(0)
    steps: list[dict[int, float]] = []
    for s in range(300):
        n = 40 if s < 150 else 5
        keys = list(range(n)) + ([99] if s > 70 else [])
        if s % 37 == 5:
            keys.remove(3)  # a parameter without a gradient this step
        if s % 53 == 7:
            keys.reverse()
        steps.append({k: rnd.choice([rnd.lognormvariate(0, 3), 1e-30, 1e300, math.inf])
                      if s % 29 == 0 else rnd.lognormvariate(0, 1) for k in keys})
    lazy = GradBaseline()
    for s, d in enumerate(steps):
        lazy.pending.append(d)
        if len(lazy.pending) >= GradBaseline.FOLD_AT:
            lazy.fold()
        if s in (0, 1, 10, 64, 65, 149, 150, 299):
            assert _bits(lazy.values()) == _bits(_eager(steps[: s + 1])), s
    assert all(type(v) is float for v in lazy.values().values())


def test_guard_baseline_through_a_run_and_its_state(tmp_path: object) -> None:
    """In a real run (an MLP of 20 parameter tensors, 150 steps), the guard's baseline equals
    the per-step update over the recorded steps' gradient norms, and survives a state_dict
    round trip."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(10) for m in (nn.Linear(8, 8), nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.Guard(model, opt, out=str(tmp_path),
                           config=GuardConfig(record=RecordConfig(summary=False)))
    x, y = torch.randn(32, 8), torch.randn(32, 8)
    healthy = []
    for _ in range(150):
        loss = nn.functional.mse_loss(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = guard.history[-1]  # the step just recorded
        if not stats.alarms and not stats.nonfinite_signals():
            healthy.append(dict(stats.grad_norms))
    assert len(healthy) == 150 and len(healthy[0]) == 20
    want = _bits(_eager(healthy))
    state = guard.state_dict()  # the baseline as a resume carries it
    assert _bits({int(i): v for i, v in state["grad_baseline"].items()}) == want
    guard.close()
    other = nanguard.Guard(model, opt, out=str(tmp_path) + "-2",
                           config=GuardConfig(record=RecordConfig(summary=False)))
    other.load_state_dict(state)
    again = other.state_dict()["grad_baseline"]
    assert _bits({int(i): v for i, v in again.items()}) == want
    other.close()
