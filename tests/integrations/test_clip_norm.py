"""The grad norm before the script's own clipping (`steps.clip_norm`), and the spike score of
the grad norm taken on it, as OLMo takes it: under `nanguard run` (its `clip_grad_norm_`
wrapper) and through `Guard.note_clip_norm`. A script that clips at 1.0 hands the optimizer
gradients of norm <= 1: scored on those, a gradient spike the clip absorbed was invisible."""

from __future__ import annotations

import json
import math
import sqlite3
from pathlib import Path

import torch
from _run import report

import nanguard
from nanguard.run.runner import RunOptions, run

CLIPPING = """
import json
import sys
import torch
from torch import nn
torch.manual_seed(0)
X = torch.randn(2048, 8)
Y = X[:, :1] * 2
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
norms = []
for step in range(60):
    x, y = X[step * 32:(step + 1) * 32], Y[step * 32:(step + 1) * 32]
    if step == 45:
        y = y * 1000  # one bad batch: a gradient spike the clip absorbs
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
    opt.step()
json.dump(norms, open(sys.argv[1], "w"))
"""


def _olmo_score(xs: list[float], window: int = 1000, min_window: int = 20,
                sigmas: float = 7.0) -> float:
    """The spike score written out from its definition (population std, floored at 1e-6 of
    |mean|), independently of nanguard's meter."""
    spikes = scored = 0
    for i, x in enumerate(xs):
        prev = xs[max(0, i - window):i]
        if len(prev) < min_window:
            continue
        mean = sum(prev) / len(prev)
        std = max(math.sqrt(sum((v - mean) ** 2 for v in prev) / len(prev)), 1e-6 * abs(mean))
        scored += 1
        spikes += abs(x - mean) > sigmas * std
    return spikes / scored


def test_nanguard_run_records_the_norm_before_the_scripts_clip(tmp_path: Path) -> None:
    script = tmp_path / "clip.py"
    script.write_text(CLIPPING)
    out, norms_file = tmp_path / "run", tmp_path / "norms.json"
    assert run(RunOptions(script=str(script), args=[str(norms_file)], out=str(out),
                          summary=False)) == 0
    norms = json.loads(norms_file.read_text())  # what the script's own clip returned
    db = sqlite3.connect(out / "run.db")
    rows = db.execute("SELECT grad_norm, clip_norm FROM steps ORDER BY step").fetchall()
    db.close()
    assert len(rows) == 60
    assert [r[1] for r in rows] == norms  # the same float32 values, read as floats
    assert max(r[0] for r in rows) <= 1.0 + 1e-5  # the optimizer's were clipped
    # The detectors judge the clip's total too: the spike at 45 is named in its terms.
    at_45 = [a for a in report(out)["alarms"] if a["step"] == 45 and a["signal"] == "grad_norm"]
    assert at_45 and at_45[0]["message"].startswith("grad norm before your clip "), at_45
    measures = report(out)["spike_measures"]
    assert measures["score"]["grad_norm"] == round(_olmo_score(norms), 6) > 0
    assert _olmo_score([r[0] for r in rows]) != _olmo_score(norms)  # the clipped series differs


def test_api_note_clip_norm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nanguard.Guard(model, opt, out=tmp_path / "api")
    given = []
    for step in range(5):
        loss = model(torch.randn(8, 4) * (step + 1)).pow(2).mean()
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        if step != 3:  # a step without it records none
            guard.note_clip_norm(total)
            given.append(float(total))
        opt.step()
    guard.close()
    db = sqlite3.connect(tmp_path / "api" / "run.db")
    got = [r[0] for r in db.execute("SELECT clip_norm FROM steps ORDER BY step")]
    db.close()
    assert got[:3] + got[4:] == given and got[3] is None
