"""Diagnosis rules: each cause fires on its evidence and stays quiet otherwise; end-to-end, the
right cause is ranked first for real failing runs (bad row, bad label, Adam eps=0, the cascade)
and a healthy run gets no diagnosis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard
from nanguard.config import GuardConfig, RecordConfig
from nanguard.explain import Evidence, diagnose
from nanguard.explain import rules as R
from nanguard.scenarios import train_cascade


def _ev(**first: object) -> Evidence:
    return Evidence(first_nonfinite={"step": 5, **first})


CASES = [
    (R.data_nonfinite, _ev(phase="data", samples=[3]), _ev(phase="forward", op="aten.mm")),
    (
        R.label_nonfinite,
        Evidence(first_nonfinite={"step": 1, "phase": "data"}, bad_tensors=[1], n_batch_tensors=2),
        Evidence(first_nonfinite={"step": 1, "phase": "data"}, bad_tensors=[0], n_batch_tensors=2),
    ),
    (
        R.log_of_nonpositive,
        _ev(phase="forward", op="aten.log", inputs=[{"has_zero": True}]),
        _ev(phase="forward", op="aten.exp"),
    ),
    (
        R.saturated_loss,
        _ev(phase="loss", op="aten.binary_cross_entropy"),
        _ev(phase="loss", op="aten.binary_cross_entropy_with_logits"),
    ),
    (
        R.division_by_zero,
        _ev(phase="forward", op="aten.div", inputs=[{}, {"has_zero": True}]),
        _ev(phase="forward", op="aten.mul"),
    ),
    (
        R.singular_gradient,
        _ev(phase="backward", op="aten.div"),
        _ev(phase="forward", op="aten.div"),
    ),
    (
        R.masked_softmax,
        _ev(phase="forward", op="aten._softmax"),
        _ev(phase="forward", op="aten.mm"),
    ),
    (R.exp_overflow, _ev(phase="forward", op="aten.exp"), _ev(phase="forward", op="aten.log")),
    (
        R.low_precision_overflow,
        Evidence(
            first_nonfinite={"step": 3, "phase": "forward", "op": "aten.mm"}, dtype="torch.float16"
        ),
        Evidence(
            first_nonfinite={"step": 3, "phase": "forward", "op": "aten.mm"}, dtype="torch.float32"
        ),
    ),
    (
        R.optimizer_state_nonfinite,
        Evidence(first_nonfinite={"step": 9, "phase": "optimizer"}, eps=0.0, optimizer="Adam"),
        Evidence(first_nonfinite={"step": 9, "phase": "backward"}, eps=0.0, optimizer="Adam"),
    ),
    (
        R.optimizer_divergence,
        Evidence(
            first_nonfinite={"step": 20, "phase": "loss"},
            lr=0.05,
            healthy_grad_norm=1.0,
            alarms=[{"step": 15, "kind": "spike", "signal": "grad_norm", "value": 300.0}],
        ),
        Evidence(
            first_nonfinite={"step": 20, "phase": "loss"},
            alarms=[{"step": 1, "kind": "spike", "signal": "grad_norm", "value": 300.0}],
        ),
    ),
    (R.exploding_init, _ev(phase="forward", op="aten.mm", step=0), _ev(phase="forward", step=50)),
    (
        R.bad_batch,
        Evidence(alarms=[{"step": 7, "kind": "spike", "signal": "grad_norm", "value": 99.0}]),
        Evidence(),
    ),
    (
        R.vanishing_gradients,
        Evidence(
            alarms=[
                {
                    "step": 7,
                    "kind": "vanishing",
                    "signal": "grad_norm",
                    "value": 0.0,
                    "message": "grad norm tiny",
                }
            ]
        ),
        Evidence(),
    ),
    (R.nondeterministic, Evidence(reproduced=False), Evidence(reproduced=True)),
]


@pytest.mark.parametrize(
    ("rule", "positive", "negative"), CASES, ids=lambda x: getattr(x, "__name__", "")
)
def test_rule_fires_only_on_its_evidence(rule, positive, negative) -> None:
    cause = rule(positive)
    assert cause is not None and cause.cause == rule.__name__
    assert 0 < cause.confidence <= 1 and cause.evidence and cause.fix
    assert rule(negative) is None


def test_every_rule_is_registered_and_covered() -> None:
    assert {c[0] for c in CASES} == set(R.RULES)


def test_healthy_evidence_gets_no_diagnosis() -> None:
    assert diagnose(Evidence()) == []


def _loop(model, optimizer, batches, **guard_kw):
    guard = nanguard.Guard(
        model, optimizer, out="", config=GuardConfig(record=RecordConfig(summary=False)), **guard_kw
    )
    with guard:
        for x, y in batches:
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert guard.report is not None
    return guard.report


def _batches(n: int, bad_step: int | None = None, where: str = "x"):
    g = torch.Generator().manual_seed(0)
    for step in range(n):
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        if step == bad_step:
            (x if where == "x" else y)[5, 0] = float("nan") if where == "x" else float("inf")
        yield x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


@pytest.mark.parametrize(("where", "cause"), [("x", "data_nonfinite"), ("y", "label_nonfinite")])
def test_bad_row_is_diagnosed(where: str, cause: str) -> None:
    m = _model()
    report = _loop(m, torch.optim.SGD(m.parameters(), lr=0.01), _batches(40, 30, where))
    assert report.first_nonfinite["phase"] == "data"
    assert report.first_nonfinite["samples"] == [5]
    assert report.diagnosis[0]["cause"] == cause


def test_adam_eps_zero_is_diagnosed() -> None:
    # A parameter whose gradient is exactly zero: Adam with eps=0 computes 0 / 0.
    m = _model()
    m[0].weight.data[:, 3] = 0.0
    batches = [(torch.cat([torch.randn(8, 3), torch.zeros(8, 1)], 1), torch.randn(8, 1))] * 5
    report = _loop(m, torch.optim.Adam(m.parameters(), lr=1e-3, eps=0.0), batches)
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["phase"] == "optimizer"
    assert report.diagnosis[0]["cause"] == "optimizer_state_nonfinite"
    assert "eps" in report.diagnosis[0]["fix"]


def test_cascade_is_diagnosed_as_optimizer_divergence() -> None:
    guards = []

    def factory(model, optimizer):
        guards.append(
            nanguard.Guard(
                model,
                optimizer,
                out="",
                activations=True,
                config=GuardConfig(record=RecordConfig(summary=False)),
            )
        )
        return guards[0]

    train_cascade(1, factory)  # seed 1 fails at step 227 (see nanguard demo)
    report = guards[0].report
    assert report.first_nonfinite is not None
    assert report.diagnosis[0]["cause"] == "optimizer_divergence"
    assert "lr=0.05 ->" in report.diagnosis[0]["fix"]
    assert "clip_grad_norm_" in report.diagnosis[0]["fix"]


def test_healthy_run_has_no_diagnosis() -> None:
    m = _model()
    report = _loop(m, torch.optim.SGD(m.parameters(), lr=0.01), _batches(60))
    assert report.status == "healthy"
    assert report.diagnosis == []
