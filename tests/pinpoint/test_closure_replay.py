"""`optimizer.step(closure)` steps are replayed in process by `nanguard run`: the closure is
called again under the op checker before the update (pinpoint/recorded.py `ClosureRecipe`), its
ops labelled by what they are (forward, loss, backward: not `optimizer`), and training is left
bitwise as it was. The scripts run black box through `nanguard run` (the command's `main`, in the
test's process: what is read is its record and output; tests/in_process.py checks that the run
leaves the process as it found it); the expected origin is the bug each script plants (a log of
a negative number in a named module at a known step), checked first by plain PyTorch, in a
process of its own, in the same test."""

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
from torch import nn

OPT, BAD, STEPS, SAVE = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
SANITIZE = len(sys.argv) > 5

class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0
    def forward(self, h):
        return torch.log(h + self.shift)  # LOG LINE

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Softplus(), Head(), nn.Linear(8, 1))
if OPT == "lbfgs":
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=1)
elif OPT == "adam":
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
else:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
calls = 0
seen = []
for step in range(STEPS):
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    model[3].shift = -1e4 if step == BAD else 0.0  # every input of the log negative: NaN
    def closure():
        global calls
        calls += 1
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        seen.append(loss.detach())
        print("loss", float(loss))
        loss.backward()
        if SANITIZE:
            for p in model.parameters():
                p.grad.nan_to_num_(0.0, 0.0, 0.0)
        return loss
    opt.step(closure)
torch.save({"params": {k: v.detach() for k, v in model.state_dict().items()},
            "calls": calls, "seen": len(seen)}, SAVE)
"""


def _line(text: str) -> int:
    return next(i for i, t in enumerate(SCRIPT.splitlines(), 1) if text in t)


def _first_nan_step(cwd: Path, opt: str, steps: int) -> tuple[int | None, str]:
    """Plain PyTorch, no nanguard: the first step whose loss is NaN (the planted bug), and
    what the script printed."""
    (cwd / "plain").mkdir()
    r = run_python(cwd / "plain", str(cwd / "train.py"), opt, "3", str(steps), "p.pt")
    losses = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("loss ")]
    # One closure call per step for SGD / Adam / LBFGS(max_iter=1) until the NaN.
    return next((i for i, v in enumerate(losses) if v == "nan"), None), r.stdout


@pytest.mark.parametrize("opt", ["sgd", "lbfgs"])
def test_closure_step_is_replayed_in_process(tmp_path: Path, opt: str) -> None:
    """The origin of a NaN made inside a closure: the `aten.log` of module `3` in the forward of
    step 3 at its source line, found by replaying the closure in process (not by re-running the
    script: `--replay-budget 0` forbids that), reproduced bit for bit (dropout draws too)."""
    (tmp_path / "train.py").write_text(SCRIPT)
    first_nan, alone = _first_nan_step(tmp_path, opt, 5)
    assert first_nan == 3
    r = nanguard(["run", "--out", "run", "--replay-budget", "0", str(tmp_path / "train.py"),
                  opt, "3", "5", "g.pt"], tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    first = report.get("first_nonfinite") or {}
    got = {"status": report["status"], "replay": report["run"].get("replay"),
           **{k: first.get(k) for k in ("step", "phase", "module", "op", "source", "reproduced")}}
    want = {"status": "failed", "replay": {"status": "in-process", "step": 3}, "step": 3,
            "phase": "forward", "module": "3", "op": "aten.log",
            "source": f"train.py:{_line('# LOG LINE')}", "reproduced": True}
    assert got == want, (got, r.stderr[-2000:])
    # The replay's own print of the closure is not the script's.
    assert r.stdout.count("loss ") == alone.count("loss ")


@pytest.mark.parametrize("opt", ["adam", "lbfgs"])
def test_closure_replay_leaves_training_bitwise_unchanged(tmp_path: Path, opt: str) -> None:
    """With the NaN gradients zeroed by the script, training goes on after the replayed step;
    the parameters (and the closure's own counters and lists, which the replay ran again) end
    bitwise as in the script run alone."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "plain").mkdir()
    args = (str(tmp_path / "train.py"), opt, "3", "8")
    r = run_python(tmp_path / "plain", *args, str(tmp_path / "alone.pt"), "sanitize")
    assert r.returncode == 0, r.stderr
    r = nanguard(["run", "--out", "run", "--replay-budget", "0", *args,
                  str(tmp_path / "watched.pt"), "sanitize"], tmp_path)
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["run"].get("replay") == {"status": "in-process", "step": 3}, r.stderr[-2000:]
    alone, watched = torch.load(tmp_path / "alone.pt"), torch.load(tmp_path / "watched.pt")
    assert (alone["calls"], alone["seen"]) == (watched["calls"], watched["seen"])
    different = [k for k in alone["params"]
                 if not torch.equal(alone["params"][k], watched["params"][k])]
    assert different == []
