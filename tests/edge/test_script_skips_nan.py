"""A script that steps over its own non-finite losses (`if not torch.isfinite(loss):
continue`, the most common hand-written NaN guard): a NaN row in a batch whose loss never
reaches an update must not make the run `failed`, nor say "NaN/Inf from here on".

The rows are planted by the test, so which batches hold NaN is known without nanguard; the
script's own check is what skips them, and the parameters stay finite (checked directly).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from nanguard import Guard, GuardConfig, RecordConfig, WatchConfig


def test_a_nan_row_the_script_skipped_is_recovered_not_failed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    x[37, 3] = float("nan")  # batch 1 (rows 32-63), row 5
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = Guard(model, opt, out=tmp_path, config=GuardConfig(
        watch=WatchConfig(activations=True), record=RecordConfig(summary=False)))
    skipped = []
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        for epoch in range(2):
            for i, (xb, yb) in enumerate(DataLoader(TensorDataset(x, y), batch_size=32)):
                loss = nn.functional.mse_loss(model(xb), yb)
                if not torch.isfinite(loss):
                    skipped.append((epoch, i))
                    continue
                g.watch(loss=loss, batch=(xb, yb))
                opt.zero_grad()
                loss.backward()
                opt.step()
        report = g.close()
    assert skipped == [(0, 1), (1, 1)]  # the script's own check, both epochs
    assert all(torch.isfinite(p).all() for p in model.parameters())
    first = report.first_nonfinite
    assert first is not None and first["signals"] == ["activation"], first
    assert first["step"] == 1 and first["skipped_by"] == "script"
    assert report.status == "recovered"
    assert first["module"] == "0"  # the first layer read the NaN row
    lines = [r.getMessage() for r in caplog.records if "nonfinite" in r.getMessage()]
    assert lines and "no update used it" in lines[0] and "from here on" not in lines[0]
    assert math.isfinite(report.spike_measures["time_in_spike"])
