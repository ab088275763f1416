"""A buffer training does not read is a warning, not the first failure: a tabular model whose
first layer is a BatchNorm over raw features, one of them in raw units (~1e19: bytes). Its
batch variance overflows float32, so the running variance turns inf at the first step; the
training-mode forward normalises by the batch's own statistics and never reads it, and the
loss stays finite. Both facts are checked by the loop itself, without nanguard."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import nanguard


def test_batchnorm_running_var_overflow_is_a_warning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    x[:, 3] = x[:, 3].sign() * 1.4e19  # a byte count in raw units
    y = x[:, :3].sum(1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nanguard.Guard(model, opt, out=str(tmp_path / "run"))
    first_inf, losses = None, []
    for step, (xb, yb) in enumerate(loader):
        loss = nn.functional.mse_loss(model(xb), yb)
        guard.watch(loss=loss, batch=(xb, yb))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if first_inf is None and not bool(torch.isfinite(model[0].running_var).all()):
            first_inf = step
    guard.close()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert first_inf == 0 and all(math.isfinite(v) for v in losses)  # the independent facts
    kinds = [(a["kind"], a["step"]) for a in report["alarms"]]
    got = {"status": report["status"], "first_nonfinite": report["first_nonfinite"],
           "alarms": kinds}
    want = {"status": "warned", "first_nonfinite": None,
            "alarms": [("buffer_nonfinite", first_inf)]}
    assert got == want, report["alarms"]
    assert "0.running_var" in report["alarms"][0]["message"]
