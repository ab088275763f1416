"""A failure a bad batch set off and the optimizer fed back (examples/train.py's story): the
diagnosis is the optimizer's, and it keeps what the live spike line said about the batch."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import nanguard


def _train(tmp: Path, outlier: bool) -> nanguard.Report:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.01), nn.Linear(64, 64),
                          nn.LeakyReLU(0.01), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    target = torch.randn(16, 1) / 4

    def loss_of(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return nn.functional.mse_loss(model(batch[0]), batch[1])

    guard = nanguard.Guard(model, opt, out=tmp, replay=loss_of)
    for step in range(30):
        x = torch.randn(32, 16)
        if outlier and step == 10:
            x[0] *= 25  # the planted bad row
        y = x @ target + 0.1 * torch.randn(32, 1)
        loss = loss_of((x, y))
        guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard.close()


def test_the_diagnosis_keeps_the_bad_batch_that_set_the_failure_off(tmp_path: Path) -> None:
    report = _train(tmp_path / "bad", outlier=True)
    assert report.first_nonfinite is not None
    first = next(s for s in report.spikes if s["step"] == 10)
    assert first.get("cause") == "bad_batch" and first.get("rows") == [0]
    top = report.diagnosis[0]
    assert top["cause"] == "optimizer_divergence", top
    assert "it began with a bad batch at step 10" in top["evidence"], top["evidence"]
    assert "find the bad batch" in top["fix"], top["fix"]
    # Without the planted row the same run stays finite: the batch set it off.
    clean = _train(tmp_path / "clean", outlier=False)
    assert clean.first_nonfinite is None and clean.status == "healthy"
