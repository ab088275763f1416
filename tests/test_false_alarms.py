"""No false alarms at default thresholds on healthy runs (DESIGN.md section 5, "false alarms").

MLP regression, a small CNN (BatchNorm, converges to a near-zero loss: a long plateau with
heavy-tailed gradient norms) and a small causal transformer LM, 10 seeds each, 300 steps with
linear warm-up then cosine decay; Adam/AdamW on even seeds, SGD with momentum on odd ones.
Activation watching is on, so its signals are held to the same bar. Each run must learn (the
loss falls) and end `healthy` with no alarm at all.
"""

from __future__ import annotations

import pytest

from helpers import make_cnn, make_lm, make_mlp, make_optimizer, train, warmup_cosine
from nanguard import Guard

STEPS = 300
WARMUP = 30
TASKS = {"mlp": make_mlp, "cnn": make_cnn, "lm": make_lm}
# (task, optimizer kind) -> peak learning rate.
LR = {
    ("mlp", "adam"): 3e-3,
    ("mlp", "sgd"): 0.05,
    ("cnn", "adamw"): 3e-3,
    ("cnn", "sgd"): 0.05,
    ("lm", "adamw"): 3e-3,
    ("lm", "sgd"): 0.1,
}


def _optimizer_kind(task: str, seed: int) -> str:
    if seed % 2:
        return "sgd"
    return "adam" if task == "mlp" else "adamw"


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("name", list(TASKS))
def test_healthy_run_raises_no_alarm(name, seed, quiet_config):
    task = TASKS[name](seed)
    kind = _optimizer_kind(name, seed)
    optimizer = make_optimizer(kind, task.model, LR[(name, kind)])
    scheduler = warmup_cosine(optimizer, STEPS, WARMUP)
    guard = Guard(task.model, optimizer, out="", activations=True, config=quiet_config())
    losses = train(task, optimizer, STEPS, guard=guard, scheduler=scheduler)
    report = guard.close()

    assert report.steps == STEPS
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, f"{name}/{kind} did not learn: {first:.3g} -> {last:.3g}"
    assert report.alarms == [], f"{name}/{kind} seed {seed}: false alarms {report.alarms}"
    assert report.status == "healthy"
    assert report.first_nonfinite is None
