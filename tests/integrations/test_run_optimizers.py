"""`nanguard run` on scripts with several optimizers: their findings ordered by the script's
own step count (a WGAN-GP whose critic steps 3 times per generator step), and optimizers built
one after the other over the same parameters (a new one every epoch) as one chain."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from _run import report

from nanguard.run.runner import RunOptions, run

WGAN_GP = """
import torch
from torch import nn
torch.manual_seed(0)
G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
D = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
nn.init.constant_(D[0].bias, -20.0)  # every critic unit dead: d critic / d input is exactly 0
og = torch.optim.Adam(G.parameters(), lr=1e-4)
od = torch.optim.Adam(D.parameters(), lr=1e-4)
for it in range(2):
    for _ in range(3):  # three critic steps per generator step
        x, fake = torch.randn(16, 2), G(torch.randn(16, 4)).detach()
        a = torch.rand(16, 1)
        inter = (a * x + (1 - a) * fake).requires_grad_(True)
        g, = torch.autograd.grad(D(inter).sum(), inter, create_graph=True)
        gp = ((g.pow(2).sum(1).sqrt() - 1) ** 2).mean()
        ld = D(fake).mean() - D(x).mean() + 10 * gp
        od.zero_grad()
        ld.backward()
        od.step()
    lg = -D(G(torch.randn(16, 4))).mean()
    og.zero_grad()
    lg.backward()
    og.step()
"""


def test_two_optimizers_first_failure_in_script_order(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A critic stepped 3 times per generator step: its step 0 (the script's first step) made
    the NaN, in the backward of a hand-written gradient penalty (sqrt at 0); the generator's
    own step 0 (the script's 4th) only met the critic's NaN weights. Each optimizer counts its
    own steps: ordering by them put the generator first and blamed its init."""
    script = tmp_path / "wgan.py"
    script.write_text(WGAN_GP)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), summary=False))
    assert rc == 1
    rep = report(out)
    first = rep["first_nonfinite"]
    assert (first["part"], first["step"], first["global_step"], first["phase"]) == (
        "optimizer-0", 0, 0, "backward")
    line = WGAN_GP.splitlines().index("        gp = ((g.pow(2).sum(1).sqrt() - 1) ** 2).mean()")
    assert first["source"].endswith(f"wgan.py:{line + 1}")
    assert rep["diagnosis"][0]["cause"] == "singular_gradient"
    gen = report(out / "optimizer-1")["first_nonfinite"]
    assert (gen["step"], gen["global_step"]) == (0, 3)
    # Once there are two guards, each one's live lines say which part they are about.
    lines = [r.getMessage() for r in caplog.records if r.name == "nanguard"]
    assert any(line.startswith("optimizer-1: step 0 nonfinite") for line in lines), lines


NEW_OPTIMIZER_EACH_EPOCH = """
import torch
from torch import nn
torch.manual_seed(0)
X = torch.randn(64, 8)
Y = X.sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
for epoch in range(4):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 * 0.8 ** epoch)  # a new one each epoch
    for i in range(0, 64, 16):
        loss = nn.functional.mse_loss(model(X[i:i + 16]), Y[i:i + 16])
        opt.zero_grad()
        loss.backward()
        opt.step()
critic = nn.Linear(8, 1)  # another model's optimizer: its own part, not in the chain
copt = torch.optim.SGD(critic.parameters(), lr=0.1)
for i in range(3):
    critic(X).pow(2).mean().backward()
    copt.step()
"""


def test_optimizers_rebuilt_each_epoch_are_one_chain(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A script that builds a new optimizer every epoch over the same parameters: the merged
    headline counts the chain's steps (16, not one part's 4), the record names the chain, the
    summary says what it costs (fresh detectors each epoch) and how to keep one run, and
    prints one table for it; another model's optimizer stays a part of its own."""
    script = tmp_path / "epochs.py"
    script.write_text(NEW_OPTIMIZER_EACH_EPOCH)
    out = tmp_path / "run"
    assert run(RunOptions(script=str(script), out=str(out))) == 0  # in this process
    r = capsys.readouterr()  # the closing summary, on stderr (r.err)
    rep = report(out)
    assert rep["status"] == "healthy" and rep["steps"] == 16
    assert rep["run"]["optimizer_chains"] == [[f"optimizer-{i}" for i in range(4)]]
    assert "healthy after 16 steps" in r.err
    assert ("optimizer-0 .. optimizer-3: 4 optimizers over the same parameters, one after "
            "the other (16 steps in all, ~4 each): one training") in r.err
    assert "optimizer-3 (" in r.err and "optimizer-4 (" in r.err  # tables shown
    assert "optimizer-0 (" not in r.err and "optimizer-2 (" not in r.err


EPOCH_SPIKE = """
import json
import sys
import torch
from torch import nn
torch.manual_seed(0)
X = torch.randn(40 * 16, 8)
Y = X[:, :1].clone()
Y[29 * 16:30 * 16] *= 10  # the batch of step 29 (epoch 3, its 6th step): labels 10x
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
norms = []
for epoch in range(5):
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * 0.9 ** epoch)  # a new one each epoch
    for i in range(8):
        s = epoch * 8 + i
        loss = nn.functional.mse_loss(model(X[s * 16:(s + 1) * 16]), Y[s * 16:(s + 1) * 16])
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])))
        opt.step()
json.dump(norms, open(sys.argv[1], "w"))
"""


def test_a_spike_early_in_an_epoch_is_judged_against_the_epochs_before(tmp_path: Path) -> None:
    """A new optimizer every 8 steps: the gradient spike of step 29 (epoch 3's 6th step) is
    ~12x the median of the 29 norms before it (the script's own, computed here), but below
    the 20x an unwarmed detector asks. Each part now starts from the baselines of the one it
    replaces, so the spike is said (it was not: every part began with 5 steps of history)."""
    script = tmp_path / "epochs.py"
    script.write_text(EPOCH_SPIKE)
    out, norms_file = tmp_path / "run", tmp_path / "norms.json"
    assert run(RunOptions(script=str(script), args=[str(norms_file)], out=str(out),
                          summary=False, replay_budget=0)) == 0
    norms = json.loads(norms_file.read_text())
    ratio = norms[29] / statistics.median(norms[:29])
    assert 10 <= ratio < 20  # a spike by the full rule, not by the early one
    alarms = [a for a in report(out)["alarms"] if a["kind"] == "spike"]
    spikes = [a for a in alarms if a["signal"] == "grad_norm"]
    assert [(a["part"], a["step"]) for a in spikes] == [("optimizer-3", 5)], alarms
    assert abs(spikes[0]["value"] - norms[29]) <= 1e-3 * norms[29]
    # The batch's own loss (labels 10x) spikes with it: the spike is that batch's.
    assert {(a["part"], a["step"], a["signal"], a.get("cause")) for a in alarms} == {
        ("optimizer-3", 5, "grad_norm", "bad_batch"), ("optimizer-3", 5, "loss", "bad_batch")}
