"""`preflight`: flags a layer initialised 100x too large and a Sigmoid -> BCELoss, runs an LR
range probe, overfits one batch on a sane model, and leaves the user's model, optimizer and
RNG state bitwise unchanged."""

from __future__ import annotations

import torch
from torch import nn

from nanguard.audit import PreflightConfig, preflight

FAST = PreflightConfig(overfit_steps=60, lr_steps=30)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def test_sane_model_overfits_and_probe_reports_divergence():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    report = preflight(model, _batch(), nn.CrossEntropyLoss(), opt, config=FAST)
    assert report.ok, str(report)
    assert report.overfit is not None and report.overfit.success
    assert report.overfit.final_loss < 0.1 * report.overfit.first_loss
    probe = report.lr_probe
    assert probe is not None and probe.diverge_lr is not None
    assert FAST.lr_min < probe.diverge_lr <= FAST.lr_max
    assert probe.suggested_lr == probe.diverge_lr / 10
    assert "LR range probe: loss diverges at lr" in str(report)
    assert [round(layer.ratio, 1) for layer in report.layers] == [0.6, 0.6]  # PyTorch default


def test_flags_exploding_init_and_sigmoid_bce():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
    with torch.no_grad():
        model[2].weight.mul_(100)
    x, y = _batch()
    report = preflight(model, (x, (y > 0).float()[:, None]), nn.BCELoss(), config=FAST)
    codes = {f.code: f for f in report.findings}
    assert codes["exploding_init"].location == "2"
    assert codes["saturated_loss"].severity == "warning"
    assert not report.ok


def test_sigmoid_inside_forward_is_seen():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, x):
            return torch.sigmoid(self.fc(x))

    x, y = _batch()
    report = preflight(Net(), (x, (y > 0).float()[:, None]),
                       nn.functional.binary_cross_entropy, config=FAST)  # fmt: skip
    assert "saturated_loss" in {f.code for f in report.findings}


def test_user_state_is_bitwise_unchanged():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5),
                          nn.Linear(16, 3))  # fmt: skip
    model.eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batch()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # the optimizer now has momentum state
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {k: v["momentum_buffer"].clone() for k, v in opt.state.items()}
    grads = [p.grad.clone() for p in model.parameters()]
    rng = torch.get_rng_state()
    preflight(model, (x, y), nn.CrossEntropyLoss(), opt, config=FAST)
    assert all(torch.equal(params[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(opt_state[p], s["momentum_buffer"]) for p, s in opt.state.items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert not model.training
    assert opt.param_groups[0]["lr"] == 0.1
