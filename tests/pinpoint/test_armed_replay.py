"""`armed` on whole scripts (the cascade re-run with the checker armed at its failing step),
`StepSnapshot` round trips, a replay that does not reproduce, intended -inf masks, and the
spike attribution (layers and per-sample gradients)."""

import copy
from pathlib import Path

import torch
from torch import nn

from nanguard.pinpoint import (
    Origin,
    StepSnapshot,
    armed,
    find_origin,
    replay_step,
    spike_attribution,
    step_fingerprint,
)
from scenarios import cascade, load


def test_armed_cascade_whole_script() -> None:
    n = cascade.first_nonfinite_step()
    with armed(n) as a:
        cascade.run_script()
    assert a.ran and a.origin is not None
    o = a.origin
    exp = cascade.EXPECTED
    assert (o.step, o.phase, o.module, o.op) == (n, exp["phase"], exp["module"], exp["op"])
    assert o.source is not None
    path, _, line = o.source.rpartition(":")
    assert "model(x)" in Path(path).read_text().splitlines()[int(line) - 1]  # step_loss


def test_armed_earlier_step_is_clean_and_step0_arms_at_once() -> None:
    n = cascade.first_nonfinite_step()
    with armed(n - 1) as a:
        cascade.run_script(steps=n + 2)
    assert a.ran and a.origin is None
    b = load("data_nan_input").build()
    with armed(0) as a:
        b.step()
    assert a.origin is not None and a.origin.phase == "data" and a.origin.samples == [5]


def test_snapshot_round_trip() -> None:
    b = load("healthy_mlp").build()
    b.step()  # Adam state with step counters
    snap = StepSnapshot.capture(b.model, b.optimizer)
    before = copy.deepcopy(b.optimizer.state_dict())
    params = [p.detach().clone() for p in b.model.parameters()]
    r = torch.rand(3)
    b.step()
    b.step()
    snap.restore()
    assert all(torch.equal(p, q) for p, q in zip(b.model.parameters(), params, strict=True))
    after = b.optimizer.state_dict()
    for k, st in before["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][key]))
    assert torch.equal(torch.rand(3), r)  # RNG restored


def test_replay_not_reproduced() -> None:
    b = load("sqrt_zero").build()
    snap = StepSnapshot.capture(b.model, b.optimizer)
    o = replay_step(b.step, model=b.model, optimizer=b.optimizer, snapshot=snap,
                    fingerprint="0" * 32)
    assert o is not None and o.reproduced is False and o.op == "aten.div"
    h = load("healthy_mlp").build()
    snap = StepSnapshot.capture(h.model, h.optimizer)
    assert replay_step(h.step, model=h.model, optimizer=h.optimizer, snapshot=snap) is None
    fp = step_fingerprint(h.model, None)
    o = replay_step(h.step, model=h.model, optimizer=h.optimizer, snapshot=snap,
                    fingerprint=fp)  # the parameters moved, so the fingerprint differs
    assert isinstance(o, Origin) and o.kind == "none" and o.reproduced is False


def test_intended_masks_are_not_origins() -> None:
    model = nn.Linear(4, 4)

    def step() -> None:
        x = model(torch.randn(2, 3, 4))
        causal = torch.triu(torch.full((3, 3), float("-inf")), diagonal=1)
        s = x @ x.transpose(1, 2) + causal
        s[:, 0, 1:] = float("-inf")
        pad = torch.where(torch.tensor([True, False, True]), 0.0, float("-inf"))
        torch.softmax(s + pad, -1).sum().backward()

    assert find_origin(step, model=model) is None


def test_spike_attribution_names_layer_and_sample() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    base = spike_attribution(model, nn.functional.mse_loss, (x, y), per_sample=False)
    x2, y2 = x.clone(), y.clone()
    y2[9] = 500.0  # one extreme target: a finite bad batch
    r = spike_attribution(model, nn.functional.mse_loss, (x2, y2), baseline=base.grad_norms)
    assert r.samples and r.samples[0]["index"] == 9
    assert r.layers and r.layers[0]["module"] in {"0", "2"} and r.layers[0]["ratio"] > 10
    assert len(r.sample_norms) == 32


def test_absorbed_log_minus_inf_is_the_origin_of_its_backward_nan() -> None:
    """`nll_loss(log(p), y)` reads only the target entries: a `-inf` elsewhere (column 2,
    never a target) never flows on in forward, but `LogBackward0` makes 0 / 0 = NaN from it,
    which reaches the weights: the `log` is the origin, not the backward division."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with armed(0) as a:
        p = torch.softmax(model(torch.randn(5, 4)), 1) * torch.tensor([1.0, 1.0, 0.0])
        loss = nn.functional.nll_loss(torch.log(p), torch.tensor([0, 1, 0, 0, 1]))
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
    o = a.origin
    assert o is not None and (o.phase, o.op, o.kind) == ("loss", "aten.log", "op")
    assert o.reproduced is True and o.propagated_by is not None
    assert (o.propagated_by["phase"], o.propagated_by["node"]) == ("backward", "LogBackward0")
    assert not torch.isfinite(model.weight).all()  # the NaN did reach the parameters
