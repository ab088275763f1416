"""The snapshot ring: a rollback returns to a state from before the trouble began, not to step 0
and not to a snapshot taken inside the lead-up; the ring stays within the memory budget the user
set; the report says how much memory the snapshots hold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.config import RecoverConfig
from nanguard.recover.ring import SnapshotRing
from nanguard.scenarios.cascade import train_cascade


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_ring_keeps_its_slots_and_restores_the_newest_before_a_bound() -> None:
    model, opt = _model()
    _step(model, opt)  # Adam's state exists: every slot has the same size
    ring = SnapshotRing(model, opt, slots=2)
    states = {}
    for step in (10, 20, 30):
        ring.capture(step)
        states[step] = [p.detach().clone() for p in model.parameters()]
        _step(model, opt)
    assert ring.steps == [20, 30]  # the oldest slot was refreshed in place
    assert ring.restore(before=25) == 20
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), states[20], strict=True))
    assert ring.steps == [20]  # the newer one belonged to the discarded steps
    assert ring.restore(before=5) == 20  # none that old: the oldest held


def test_ring_stays_within_the_budget() -> None:
    model, opt = _model()
    _step(model, opt)
    one = SnapshotRing(model, opt, slots=1)
    one.capture(0)
    copy = one.nbytes
    ring = SnapshotRing(model, opt, slots=3, budget_bytes=int(2.5 * copy))
    for step in range(5):
        ring.capture(step)
        assert ring.nbytes <= 2.5 * copy
    assert len(ring.slots) == 2 and not ring.over_budget
    tiny = SnapshotRing(model, opt, slots=3, budget_bytes=copy // 2)
    tiny.capture(0)
    tiny.capture(1)
    assert len(tiny.slots) == 1 and tiny.over_budget  # one is kept: rollback needs it


@pytest.mark.parametrize("bad", [{"snapshot_slots": 0}, {"snapshot_budget_mb": 0.0},
                                 {"snapshot_budget_mb": -1.0},
                                 {"snapshot_budget_mb": float("nan")}])
def test_bad_ring_settings_are_a_value_error(bad: dict) -> None:
    with pytest.raises(ValueError, match="snapshot_"):
        GuardConfig(recover=RecoverConfig(**bad))


def test_cascade_rollback_returns_to_a_state_before_the_trouble() -> None:
    """Seed 9 of the cascade, with spikes recorded but not acted on (by default their update
    is discarded and no cascade follows): a spike at 17, the loss climbing from ~29
    (divergence alarm at 33), the cascade rolled back at 45. Snapshots every 10 quiet steps:
    the one of step 30 lies inside the lead-up (the divergence's 5-step window starts at 28),
    so the rollback restores step 10, from before the trouble, and not step 0."""
    guards: list[Guard] = []
    cfg = GuardConfig(act_on=("nonfinite", "cascade", "forecast", "overflow"),
                      record=RecordConfig(out="", summary=False))

    def factory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Guard:
        guards.append(Guard(model, optimizer, policy="rollback", activations=True, config=cfg))
        return guards[0]

    _, losses = train_cascade(9, factory, steps=120)
    report = guards[0].report
    assert report is not None
    rollbacks = [a for a in report.actions if a["action"] == "rollback"]
    assert rollbacks, report.actions
    first_alarm = min(a["step"] for a in report.alarms)
    restored = int(rollbacks[0]["detail"].split("state of step ")[1].split(",")[0])
    assert 0 < restored <= first_alarm, (restored, first_alarm, report.alarms[:5])
    assert restored < rollbacks[0]["step"] - 10  # not the newest snapshot (step 30 or 40)
    cost = report.run["recovery"]
    assert cost["snapshots"] == 2 and cost["snapshot_bytes"] > 0
    assert cost["snapshot_budget_bytes"] is None and cost["snapshot_over_budget"] is False
    assert report.status == "recovered" and sum(losses[-20:]) / 20 < 0.1
