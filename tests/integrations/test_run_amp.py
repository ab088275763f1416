"""`nanguard run` finds a script's GradScaler by itself (run/amp_scalers.py): a step the
scaler skips for an fp16 overflow is counted, never an alarm, and the loss is recorded in the
script's units, not times the scale.

The expected skips come from the script's own log: an iteration whose scale fell in its
`update()` is one the scaler skipped (torch halves the scale exactly then).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from nanguard.record.store import open_run
from nanguard.run.runner import RunOptions, run


def _fp16_autocast() -> bool:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
        return out.dtype == torch.float16
    except (RuntimeError, TypeError):
        return False


pytestmark = pytest.mark.skipif(not _fp16_autocast(), reason="no float16 autocast on this CPU")

AMP = """
import json
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu")
log = []
for it in range(30):
    x = torch.randn(16, 8)
    y = x.sum(1, keepdim=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    if it == 12:  # one blown-up loss: its scaled gradients overflow fp16
        loss = loss * (torch.finfo(torch.float16).max / 10)
    before = scaler.get_scale()
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    log.append({"loss": loss.item(), "skipped": scaler.get_scale() < before})
json.dump(log, open(sys.argv[1], "w"))
"""


def test_gradscaler_skips_are_counted_and_the_loss_is_unscaled(tmp_path: Path) -> None:
    script = tmp_path / "amp.py"
    script.write_text(AMP)
    out, log_file = tmp_path / "run", tmp_path / "log.json"
    rc = run(RunOptions(script=str(script), args=[str(log_file)], out=str(out), summary=False))
    log = json.loads(log_file.read_text())
    stepped = [it for it, e in enumerate(log) if not e["skipped"]]
    assert log[12]["skipped"] and stepped, log  # the script's own run skipped the blow-up
    report = json.loads((out / "report.json").read_text())
    assert (rc, report["status"], report["alarms"]) == (0, "healthy", []), report
    assert report["steps"] == len(stepped)
    # Every skip after the guard's first step is counted (the ones before, at the first
    # scale, happen before any guard exists).
    counted = sum(int(m.group(1)) for a in report["actions"] if a["action"] == "amp_skip"
                  for m in [re.search(r"skipped (\d+) step", a["detail"])] if m)
    assert counted == sum(e["skipped"] for e in log[stepped[0]:])
    db = open_run(out)
    try:
        losses = [v for (v,) in db.execute("SELECT loss FROM steps ORDER BY step")]
    finally:
        db.close()
    assert losses == pytest.approx([log[it]["loss"] for it in stepped], rel=1e-6)
