"""A step whose loss is the script's own arithmetic (not a `torch.nn.functional` loss) gets its
forward replayed alone in process: when the forward's output is already non-finite, the first
non-finite value of the step was made in the forward (nothing of the step runs before it), so
that origin is exact; when the output is finite, the value was made in the loss or the backward
and nanguard falls back to the re-run of the script, saying why. Black box through
`nanguard run` (the command's `main` in the test's process: its record is what is read); the
expected origins are planted by the script (checked by plain PyTorch, in a process of its
own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_python
from in_process import nanguard

SCRIPT = """
import sys
import torch

WHERE, BAD = sys.argv[1], int(sys.argv[2])

class LogReg(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)
        self.shift = 0.0
    def forward(self, x):
        z = self.lin(x)
        z = z + torch.log(torch.ones_like(z) + self.shift)  # FORWARD LOG
        return torch.sigmoid(z)

torch.manual_seed(0)
X = torch.randn(64, 3)
Y = (X[:, :1] > 0).float()
model = LogReg()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
for step in range(BAD + 2):
    if step == BAD and WHERE == "forward":
        model.shift = -1e6  # every input of the forward's log negative: NaN
    if step == BAD and WHERE == "loss":
        with torch.no_grad():
            model.lin.bias.fill_(1e4)  # sigmoid rounds to exactly 1: log(1 - h) = -inf
    h = model(X)
    print("out-finite", bool(torch.isfinite(h).all()))
    cost = -(Y * torch.log(h) + (1 - Y) * torch.log(1 - h)).mean()  # LOSS LINE
    print("loss", float(cost))
    opt.zero_grad()
    cost.backward()
    opt.step()
"""


def _line(text: str) -> int:
    return next(i for i, t in enumerate(SCRIPT.splitlines(), 1) if text in t)


@pytest.mark.parametrize(("where", "phase", "line", "replay"), [
    ("forward", "forward", "# FORWARD LOG", "in-process"),
    ("loss", "loss", "# LOSS LINE", "found"),
])
def test_hand_written_loss(tmp_path: Path, where: str, phase: str, line: str,
                           replay: str) -> None:
    """Planted at step 4: a NaN from the forward's log (replayed in process: the forward
    alone) or a -inf from the loss line's log of 1 - h (the forward's output is finite: the
    re-run finds it, and `run.replay.in_process` says why the forward alone was not enough)."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = run_python(tmp_path, str(script), where, "4").stdout.splitlines()
    # Independently: the first non-finite loss is at step 4; its forward output is non-finite
    # exactly when the bug was planted in the forward.
    losses = [float(ln.split()[1]) for ln in plain if ln.startswith("loss ")]
    outs = [ln.split()[1] == "True" for ln in plain if ln.startswith("out-finite ")]
    assert next(i for i, v in enumerate(losses) if not torch.isfinite(torch.tensor(v))) == 4
    assert outs[4] is (where == "loss")
    r = nanguard(["run", "--out", "run", str(script), where, "4"], tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    first = report.get("first_nonfinite") or {}
    got = {"status": report["status"], "replay": report["run"]["replay"]["status"],
           **{k: first.get(k) for k in ("step", "phase", "op", "source")}}
    want = {"status": "failed", "replay": replay, "step": 4, "phase": phase, "op": "aten.log",
            "source": f"train.py:{_line(line)}"}
    assert got == want, (got, report["run"]["replay"], r.stderr[-2000:])
    if where == "forward":
        assert first["module"] == "", first  # the root module's forward
    else:
        assert "its forward alone, replayed, gives a finite output" in \
            report["run"]["replay"]["in_process"]
