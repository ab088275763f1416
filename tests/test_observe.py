"""`observe` is non-invasive (DESIGN.md section 5): after 200 steps under a guard, every parameter
and every optimizer-state tensor (Adam moments and step counters, SGD momentum) is bitwise equal
to the same seeded run without nanguard, with activation watching off and on, recording to disk
or not, and with buffered reads. The model has dropout, so a guard that consumed the RNG would
show here too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import Task, make_mlp, make_optimizer, train, warmup_cosine
from nanguard import Guard

STEPS = 200


def _task(seed: int) -> Task:
    task = make_mlp(seed)
    torch.manual_seed(seed)
    task.model = nn.Sequential(
        nn.Linear(16, 64), nn.LayerNorm(64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 1)
    )
    return task


def _run(kind: str, guard_kwargs: dict | None, config=None):
    task = _task(3)
    optimizer = make_optimizer(kind, task.model, 1e-2 if kind == "sgd" else 1e-3)
    scheduler = warmup_cosine(optimizer, STEPS, 20)
    guard = None
    if guard_kwargs is not None:
        guard = Guard(task.model, optimizer, config=config, **guard_kwargs)
    losses = train(task, optimizer, STEPS, guard=guard, scheduler=scheduler)
    if guard is not None:
        guard.close()
    return task.model, optimizer, losses


def _assert_bitwise_equal(a: tuple, b: tuple) -> None:
    (model_a, opt_a, losses_a), (model_b, opt_b, losses_b) = a, b
    assert losses_a == losses_b
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs"
    state_a, state_b = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert state_a.keys() == state_b.keys() and state_a
    for i in state_a:
        assert state_a[i].keys() == state_b[i].keys()
        for key, value in state_a[i].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(state_b[i][key])), (i, key)


@pytest.mark.parametrize(
    ("kind", "activations", "record", "read_every"),
    [
        ("adam", False, False, 1),
        ("adamw", True, False, 1),
        ("sgd", True, True, 1),
        ("adam", True, True, 4),
    ],
)
def test_observe_leaves_training_bitwise_identical(
    kind, activations, record, read_every, tmp_path, quiet_config
):
    baseline = _run(kind, None)
    out = str(tmp_path / "run") if record else ""
    config = quiet_config(out=out, read_every=read_every, activations=activations)
    guarded = _run(kind, {}, config)
    _assert_bitwise_equal(baseline, guarded)


def test_a_guard_does_not_change_what_it_watches(quiet_config):
    """The guard saw the run (so the test above compares something): steps and statistics."""
    task = _task(3)
    optimizer = make_optimizer("adam", task.model, 1e-3)
    guard = Guard(task.model, optimizer, config=quiet_config(out="", activations=True))
    train(task, optimizer, 30, guard=guard)
    report = guard.close()
    assert report.steps == 30
    last = guard.history[-1]
    assert last.grad_norm > 0 and last.param_norm > 0
    # The optimizer state on sampled steps (`watch.sampling`: every 10, and at step 0), all
    # of it; the parameters every step.
    sampled = [s.step for s in guard.history if s.state_norms]
    assert sampled == [0, 10, 20], sampled
    assert all(set(s.state_norms) == {"exp_avg", "exp_avg_sq"} for s in guard.history
               if s.state_norms)
    assert all(s.param_norms for s in guard.history)
    assert last.activations, "activation watching recorded nothing"
