"""The saturation precursor (`nanguard.watch.saturation`) on a real textbook logistic regression
in raw tensors: `h = torch.sigmoid(X @ W + b)`,
`cost = -(Y * torch.log(h) + (1 - Y) * torch.log(1 - h)).mean()`, plain SGD.

On separable data the logits grow without bound while the loss falls smoothly; the loss turns
NaN the first step an `h` rounds to exactly 1.0. The probe (armed one step in every
`saturation_every`) must warn before that step, naming the sigmoid, `log(1 - p)` and the cost's
source line. On overlapping classes the logits stay moderate: no alarm at all.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.config import DetectConfig
from nanguard.detect import ALARM_KINDS


def _logreg(separation: float, steps: int, every: int = 100) -> tuple[Guard, list[float], int]:
    g = torch.Generator().manual_seed(0)
    n = 64
    X = torch.cat([torch.randn(n, 2, generator=g) + separation,
                   torch.randn(n, 2, generator=g) - separation])
    Y = torch.cat([torch.ones(n, 1), torch.zeros(n, 1)])
    W = torch.zeros(2, 1, requires_grad=True)
    b = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([W, b], lr=0.05)
    cfg = GuardConfig(record=RecordConfig(out="", summary=False),
                      detect=DetectConfig(saturation_every=every))
    guard = Guard(nn.Module(), opt, config=cfg)  # raw tensors: no module holds them
    losses: list[float] = []
    z_max = 0.0
    for _ in range(steps):
        z = X @ W + b
        h = torch.sigmoid(z)
        cost = -(Y * torch.log(h) + (1 - Y) * torch.log(1 - h)).mean()
        guard.watch(loss=cost)
        losses.append(cost.item())
        z_max = max(z_max, z.abs().max().item())
        if not math.isfinite(losses[-1]):
            break
        opt.zero_grad()
        cost.backward()
        opt.step()
    guard.close()
    return guard, losses, int(z_max)


@pytest.mark.slow
def test_saturating_logistic_regression_warns_before_the_nan() -> None:
    guard, losses, _ = _logreg(separation=2.0, steps=3000)
    nan_at = next(i for i, v in enumerate(losses) if not math.isfinite(v))
    assert nan_at > 500  # a long, smoothly falling run first
    assert all(b <= a * 1.01 for a, b in zip(losses[:nan_at - 1], losses[1:nan_at], strict=True))
    report = guard.report
    assert report is not None and report.first_nonfinite is not None
    assert report.first_nonfinite["step"] == nan_at
    sat = [a for a in report.alarms if a["kind"] == "saturation"]
    assert sat, report.alarms
    assert "saturation" in ALARM_KINDS
    first = sat[0]
    assert first["step"] < nan_at - 100, (first["step"], nan_at)  # far ahead, not at the NaN
    assert first["signal"] == "sigmoid"
    assert "log(1 - p)" in first["message"] and "torch.log(1 - h)" in first["message"]
    # Before the NaN, only the precursor spoke: nothing else had a magnitude to warn about.
    assert {a["kind"] for a in report.alarms if a["step"] < nan_at} == {"saturation"}
    assert guard.saturation is not None and guard.saturation.armed_steps >= nan_at // 100 - 1


@pytest.mark.slow
def test_healthy_logistic_regression_raises_nothing() -> None:
    guard, losses, z_max = _logreg(separation=0.5, steps=1500)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert z_max < 10  # overlapping classes: the logits stay moderate
    report = guard.report
    assert report is not None
    assert report.alarms == [] and report.status == "healthy"
    assert guard.saturation is not None and guard.saturation.armed_steps >= 14


def test_probe_off_and_bad_setting() -> None:
    opt = torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=0.1)
    cfg = GuardConfig(record=RecordConfig(out="", summary=False),
                      detect=DetectConfig(saturation_every=0))
    guard = Guard(nn.Module(), opt, config=cfg)
    assert guard.saturation is None
    guard.close()
    with pytest.raises(ValueError, match="saturation_every"):
        GuardConfig(detect=DetectConfig(saturation_every=-1))


def test_explain_cites_the_saturation_warning() -> None:
    """`saturated_loss` on a log in the loss with no recorded input range: presumed (0.6)
    alone, confirmed (0.9) by an earlier saturation warning, which the evidence cites."""
    from nanguard.explain.evidence import Evidence
    from nanguard.explain.rules import saturated_loss

    finding = {"step": 1358, "phase": "loss", "op": "aten.log.default", "module": None}
    alone = saturated_loss(Evidence(first_nonfinite=finding))
    assert alone is not None and alone.confidence == 0.6
    warning = {"step": 700, "kind": "saturation", "signal": "sigmoid", "value": 1.0,
               "message": "sigmoid output saturating: 1 within 16 ulps of 1.0; once ..."}
    warned = saturated_loss(Evidence(first_nonfinite=finding, alarms=[warning]))
    assert warned is not None and warned.confidence == 0.9
    assert "warned from step 700" in warned.evidence and "16 ulps" in warned.evidence


def _train_probed(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor,
                  steps: int = 4) -> Guard:
    """A few real SGD steps (tiny LR: the logits stay where they were set) with the probe armed
    every step; returns the closed guard."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    cfg = GuardConfig(record=RecordConfig(out="", summary=False),
                      detect=DetectConfig(saturation_every=1))
    guard = Guard(model, opt, config=cfg)
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()
    return guard


def _linear(gap: float, classes: int) -> tuple[nn.Module, torch.Tensor]:
    """A Linear whose logits for input row 0 are (gap, 0, ..., 0) exactly."""
    model = nn.Linear(1, classes, bias=False)
    with torch.no_grad():
        model.weight.zero_()
        model.weight[0, 0] = gap
    return model, torch.ones(4, 1)


def _saturation(guard: Guard) -> list[dict]:
    assert guard.report is not None
    return [a for a in guard.report.alarms if a["kind"] == "saturation"]


@pytest.mark.parametrize(("gap", "alarm"), [(95.0, True), (80.0, False)])
def test_hand_written_log_softmax(gap: float, alarm: bool) -> None:
    """`torch.log(torch.softmax(z, 1))` by hand: a logit gap of 95 puts the other classes at
    e^-95 = 5.5e-42, below float32's smallest normal (1.18e-38): the next rounding is 0 and
    log(0) = -inf. A gap of 80 (e^-80 = 1.8e-35) is close but still normal: no alarm."""
    model, x = _linear(gap, 3)

    def loss_fn(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -(torch.log(torch.softmax(z, dim=1)) * y).sum(1).mean()

    # The confident class is the target: its loss is 0 and nothing is non-finite yet (a target
    # on a saturated class would make the log's gradient 1/p overflow at once).
    y = torch.tensor([[1.0, 0.0, 0.0]]).expand(4, 3)
    sat = _saturation(_train_probed(model, loss_fn, x, y))
    assert bool(sat) is alarm, sat
    if alarm:
        assert sat[0]["signal"] == "softmax" and "log(p)" in sat[0]["message"]
        assert "below the smallest normal" in sat[0]["message"]
        assert "torch.log(torch.softmax(z, dim=1))" in sat[0]["message"]


@pytest.mark.parametrize(("logit", "target", "alarm"),
                         [(20.0, 0.0, True), (10.0, 0.0, False), (20.0, 1.0, False)])
def test_bce_on_a_saturated_sigmoid(logit: float, target: float, alarm: bool) -> None:
    """`F.binary_cross_entropy(torch.sigmoid(z), y)`: sigmoid(20) rounds to exactly 1.0 in
    float32; with target 0 the loss is clamped at 100 (finite) and the gradient through the
    sigmoid is exactly 0, which the test checks itself. sigmoid(10) = 1 - 4.5e-5 (about 380
    ulps of 1.0 away) is close but learns: no alarm. A confident right answer (target 1): none."""
    model, x = _linear(logit, 1)
    y = torch.full((4, 1), target)

    def loss_fn(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.binary_cross_entropy(torch.sigmoid(z), t)

    # The bug's signature, measured here: a finite loss and a dead gradient.
    probe_model, _ = _linear(logit, 1)
    loss = loss_fn(probe_model(x), y)
    loss.backward()
    assert probe_model.weight.grad is not None
    dead = math.isfinite(loss.item()) and probe_model.weight.grad.abs().max().item() == 0.0
    if target == 0.0:
        assert dead is alarm
    else:  # right and certain: nothing left to learn, a zero gradient is no harm
        assert loss.item() == 0.0

    guard = _train_probed(model, loss_fn, x, y)
    sat = _saturation(guard)
    assert bool(sat) is alarm, sat
    if alarm:
        msg = sat[0]["message"]
        assert sat[0]["signal"] == "sigmoid" and "binary_cross_entropy" in msg
        assert "stop learning" in msg and "binary_cross_entropy_with_logits" in msg
    assert guard.report is not None and guard.report.first_nonfinite is None
