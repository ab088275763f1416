"""The step recording of `nanguard run` (pinpoint/recorded.py), in process on real PyTorch: what
it keeps alive (nothing of a forward the script throws away), what it leaves behind (nothing),
and the one-line reason it gives for steps it cannot replay (the runner then re-runs the
script: here with `--replay-budget 0`, so the reason is all there is to see)."""

from __future__ import annotations

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanguard.run.discovery import Discovery
from nanguard.run.runner import RunOptions, run


def test_thrown_away_forwards_and_losses_are_not_kept_alive(tmp_path: Path) -> None:
    """A grad-enabled forward (and a loss of it) the script drops between steps is freed at
    once: the recorder holds outputs and loss values weakly; the loss functions are the
    originals again after `remove()`."""
    original = F.mse_loss
    disc = Discovery(lambda i: tmp_path / f"optimizer-{i}").install()
    try:
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        hidden: list[weakref.ref[torch.Tensor]] = []  # an activation the graph saves
        model[1].register_forward_hook(lambda m, i, o: hidden.append(weakref.ref(o)))
        out = model(torch.randn(16, 4))
        val = F.mse_loss(out, torch.randn(16, 1))
        refs = [weakref.ref(out), weakref.ref(val), hidden[0]]
        assert refs[2]() is not None
        del out, val
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
        assert F.mse_loss is not original  # wrapped while installed
    finally:
        disc.remove()
    assert F.mse_loss is original


TWICE = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.Adam(model.parameters(), lr=0.01)
for step in range(6):
    a, b = torch.randn(8, 4), torch.randn(8, 4)
    gate = 0.0 if step == 4 else 1.0
    loss = torch.nn.functional.mse_loss(model(a), torch.zeros(8, 1)) \\
        + torch.nn.functional.mse_loss(model(b) * gate, torch.zeros(8, 1)).log()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


GRAD_ACCUMULATION = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    opt.zero_grad()
    for micro in range(2):
        x = torch.randn(8, 4)
        out = model(x)
        if step == 3 and micro == 1:
            out = out.log()
        torch.nn.functional.mse_loss(out, torch.zeros(8, 1)).backward()
    opt.step()
"""


IN_PLACE = """
import torch
torch.manual_seed(0)
class Log(torch.nn.Module):
    def forward(self, x):
        return x.log()
model = torch.nn.Sequential(torch.nn.Linear(4, 1), Log())
with torch.no_grad():
    model[0].bias.fill_(10.0)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.empty(8, 4)
for step in range(5):
    if step == 3:  # every output negative: log gives NaN
        x.copy_(-1e3 * model[0].weight.detach().sign().expand(8, 4))
    else:
        x.uniform_()
    loss = torch.nn.functional.mse_loss(model(x), torch.zeros(8, 1))
    opt.zero_grad()
    loss.backward()
    x.zero_()  # the input buffer is cleared for the next batch, before the update
    opt.step()
"""


@pytest.mark.parametrize(("source", "step", "reason"), [
    (IN_PLACE, 3, "the script changed the batch in place after the forward"),
    (TWICE, 4, "the model is called several times in a step"),
    (GRAD_ACCUMULATION, 3, "the loss backpropagated is not a torch.nn.functional loss"),
])
def test_steps_not_replayable_in_process_say_why(tmp_path: Path, source: str, step: int,
                                                 reason: str) -> None:
    """A batch changed in place before the update, two calls of the model before one
    backward, a micro-batch whose NaN is the script's own arithmetic on the output (a closure
    step and plain accumulation are replayed: tests/pinpoint/test_closure_replay.py, below):
    not replayed in process; the finding is the watched
    signals' (the re-run is off here) and `run.replay.in_process` says why."""
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    assert rc == 1, report
    assert report["first_nonfinite"]["step"] == step, report["first_nonfinite"]
    assert report["first_nonfinite"]["op"] is None  # not pinpointed: only the signals
    replay = report["run"]["replay"]
    assert replay["status"] == "skipped", replay
    assert replay["in_process"].startswith(reason), replay


def test_removed_discovery_leaves_no_global_hook(tmp_path: Path) -> None:
    """torch keeps a `with_kwargs` global hook's id after its handle is removed; Discovery
    clears it, so a later `torch.compile(module)` in the process sees no global hook."""
    from torch.nn.modules import module as torch_module

    assert not torch_module._has_any_global_hook()
    disc = Discovery(lambda i: tmp_path / f"optimizer-{i}").install()
    assert torch_module._has_any_global_hook()
    disc.remove()
    assert not torch_module._has_any_global_hook()


ACCUMULATED = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class LogNorm(torch.nn.Module):
    def forward(self, x):
        return torch.log(x.abs().sum(1, keepdim=True))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.scale = LogNorm()
    def forward(self, x):
        return self.lin(x) + self.scale(x)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
ACCUM = 3
for step in range(6):
    for micro in range(ACCUM):
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        if step == 4 and micro == 1:
            x[5] = 0.0  # a row of zeros: log(0) = -inf for sample 5 of micro-batch 1
        loss = F.mse_loss(model(x), y) / ACCUM
        loss.backward()
    opt.step()
    opt.zero_grad()
"""


SCALED = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class Magnitude(torch.nn.Module):
    def forward(self, h):
        return torch.sqrt(h * h)
model = torch.nn.Sequential(torch.nn.Linear(4, 1, bias=False), Magnitude())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(5):
    x = torch.rand(8, 4) + 0.5
    if step == 3:
        x[2] = 0.0  # Linear(0) = 0 (no bias): sqrt at 0 in the backward, sample 2
    loss = F.mse_loss(model(x), torch.ones(8, 1))
    opt.zero_grad()
    (loss * 0.5).backward()
    opt.step()
"""


@pytest.mark.parametrize(("source", "expected"), [
    (ACCUMULATED, {"step": 4, "phase": "forward", "module": "scale", "op": "aten.log",
                   "samples": [8 + 5], "micro_batch": 1}),
    (SCALED, {"step": 3, "phase": "backward", "module": "1", "samples": [2]}),
], ids=["accumulated", "scaled"])
def test_accumulated_and_scaled_losses_are_replayed_in_process(
        tmp_path: Path, source: str, expected: dict[str, object]) -> None:
    """Gradient accumulation (three micro-batches per update, each `F.mse_loss(...) / 3`
    backpropagated) and a loss scaled by a constant before its backward are replayed in
    process (the re-run is off: replay budget 0). The expected step, micro-batch, sample and
    module are the ones the script plants: samples are numbered across the step's
    micro-batches (8 per micro-batch), as the guard numbers them."""
    script = tmp_path / "train.py"
    script.write_text(source)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    first = report["first_nonfinite"]
    assert rc == 1, report
    assert report["run"]["replay"] == {"status": "in-process", "step": expected["step"]}, \
        report["run"]["replay"]
    assert {k: first.get(k) for k in expected} == expected, first
    assert "reproduced" in first and first["reproduced"] is not False, first
    line = next(i for i, t in enumerate(source.splitlines(), 1)
                if "torch.log(" in t or "torch.sqrt(" in t)
    assert first["source"] == f"{script}:{line}", first


GIANT_SAMPLE = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
w = torch.randn(8, 1)
for step in range(41):
    x = torch.randn(16, 8)
    y = x @ w
    if step == 40:
        x[11] *= 100.0  # one giant (finite) sample
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_spike_names_its_sample_in_a_zero_code_run(tmp_path: Path) -> None:
    """A spike seen before its update in a script run by `nanguard run`: the recorded call and
    loss are replayed on each sample of the batch alone (its rows of the input and of the
    targets), and the per-sample gradient norms name the giant sample the script planted."""
    script = tmp_path / "train.py"
    script.write_text(GIANT_SAMPLE)
    out = tmp_path / "run"
    run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    spikes = [s for s in report["spikes"] if s["step"] == 40]
    assert spikes and "error" not in spikes[0], report["spikes"]
    assert [d["index"] for d in spikes[0]["samples"]] == [11], spikes[0]
    alarm = next(a for a in report["alarms"] if a["step"] == 40 and a["kind"] == "spike")
    assert alarm["message"].endswith("samples 11; re-run: reproducible"), alarm


GAN_CRITIC = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class LogNorm(torch.nn.Module):
    def forward(self, x):
        return torch.log(x.abs().sum(1, keepdim=True))
class Critic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
        self.scale = LogNorm()
    def forward(self, x):
        return self.lin(x) + self.scale(x)
G = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
D = Critic()
opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
for step in range(8):
    real = torch.randn(16, 2) + 3.0
    fake = G(torch.randn(16, 4))
    if step == 5:
        fake = fake * (torch.arange(16) != 3).float().unsqueeze(1)  # sample 3 of the fakes: 0
    d_loss = (F.binary_cross_entropy_with_logits(D(real), ones)
              + F.binary_cross_entropy_with_logits(D(fake.detach()), zeros))
    opt_d.zero_grad()
    d_loss.backward()
    opt_d.step()
    g_loss = F.binary_cross_entropy_with_logits(D(fake), ones)
    opt_g.zero_grad()
    g_loss.backward()
    opt_g.step()
"""


def test_a_discriminator_called_on_real_and_fake_is_replayed_in_process(tmp_path: Path) -> None:
    """A GAN's discriminator step backpropagates the sum of two losses of two calls of the
    critic (`bce(D(real), 1) + bce(D(fake.detach()), 0)`): both calls are replayed, in order,
    and the sum taken again. Fake sample 3 of step 5 is zeroed by the script, so the critic's
    log makes -inf in its second call: step 5, forward, module `scale`, the log line, found in
    process (re-run off) and reproduced bit for bit; the critic's optimizer stepped first
    (`optimizer-0`)."""
    script = tmp_path / "train.py"
    script.write_text(GAN_CRITIC)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    first = report["first_nonfinite"]
    line = next(i for i, t in enumerate(GAN_CRITIC.splitlines(), 1) if "torch.log(" in t)
    got = {k: first.get(k) for k in ("step", "phase", "module", "op", "source", "part",
                                     "reproduced")}
    assert rc == 1 and got == {"step": 5, "phase": "forward", "module": "scale",
                               "op": "aten.log", "source": f"{script}:{line}",
                               "part": "optimizer-0", "reproduced": True}, first
    assert report["run"]["replay"] == {"status": "in-process", "step": 5}


FIT = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
for step in range(8):
    x = torch.randn(16, 4)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    opt.zero_grad()
    loss.backward()
    opt.step()
torch.save(model.state_dict(), sys.argv[1])
"""


@pytest.mark.parametrize("where", ["saw_call", "saw_backward", "boundary"])
def test_an_error_in_the_runners_own_hooks_never_stops_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """nanguard's own bug in a hook of `nanguard run` (the forward pre-hook, the backward hook,
    the optimizer step pre-hook) at the fourth call: every guard stands down (status
    `degraded`, the error recorded), the script runs to its end (it used to die with it), and
    its parameters are bitwise those of the script run alone."""
    from nanguard.pinpoint.recorded import StepRecorder

    script = tmp_path / "train.py"
    script.write_text(FIT)
    alone = tmp_path / "alone.pt"
    ns: dict[str, object] = {"__name__": "__main__"}
    import sys
    argv = sys.argv
    sys.argv = [str(script), str(alone)]
    try:
        exec(compile(FIT, str(script), "exec"), ns)  # noqa: S102 - the test's own script
    finally:
        sys.argv = argv
    original = getattr(StepRecorder, where)
    calls = {"n": 0}

    def broken(self: StepRecorder, *args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError("bug inside nanguard run")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(StepRecorder, where, broken)
    out = tmp_path / "run"
    watched = tmp_path / "watched.pt"
    rc = run(RunOptions(script=str(script), args=[str(watched)], out=str(out), summary=False))
    report = json.loads((out / "report.json").read_text())
    # The script ended normally; `degraded` is no status a CI gate may pass: exit 1.
    assert (rc, report["status"], report["run"]["script"]["outcome"]) == (1, "degraded", "ok")
    assert "bug inside nanguard run" in report["run"]["internal_error"]["error"]
    a, b = torch.load(alone), torch.load(watched)
    assert all(torch.equal(a[k], b[k]) for k in a)


SCALED_FOR_BACKWARD = """
import json
import sys
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for step in range(6):
    x = torch.randn(16, 4)
    loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
    losses.append(loss.item())
    opt.zero_grad()
    (loss / 4).backward()
    opt.step()
json.dump(losses, open(sys.argv[1], "w"))
"""


def test_a_loss_scaled_for_its_backward_is_recorded_in_the_scripts_units(tmp_path: Path) -> None:
    """`(loss / 4).backward()` (gradient-accumulation style): the run's loss series is the
    script's own loss (what it logs), not the quarter of it that was backpropagated; a power
    of two, so the unscaled value is exact."""
    from nanguard.record.store import dec, open_run

    script = tmp_path / "train.py"
    script.write_text(SCALED_FOR_BACKWARD)
    out = tmp_path / "run"
    run(RunOptions(script=str(script), args=[str(tmp_path / "losses.json")], out=str(out),
                   summary=False))
    logged = json.loads((tmp_path / "losses.json").read_text())
    db = open_run(out)
    try:
        recorded = [dec(v) for (v,) in db.execute("SELECT loss FROM steps ORDER BY step")]
    finally:
        db.close()
    assert recorded == logged


MODEL_RETURNS_LOSS = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1, bias=False)
    def forward(self, x, labels):
        pred = self.lin(x)
        magnitude = torch.sqrt(pred * pred)  # sqrt at 0: an infinite gradient
        return {"pred": pred, "loss": F.mse_loss(magnitude, labels)}
model = Regressor()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    x, y = torch.rand(8, 4) + 0.5, torch.ones(8, 1)
    if step == 4:
        x[6] = 0.0  # lin(0) = 0 (no bias)
    out = model(x, labels=y)
    opt.zero_grad()
    (out["loss"] / 2).backward()
    opt.step()
"""


def test_a_loss_the_model_returns_scaled_is_replayed_in_process(tmp_path: Path) -> None:
    """`(model(x, labels=y)["loss"] / 2).backward()` (the transformers style: the model
    computes its loss; accumulation scales it): the output's loss element is tagged and read
    back through the division, so a NaN made in the backward (sqrt at 0, sample 6 of step 4:
    the forward is finite, a forward replayed alone could not see it) is found in process,
    its loss compared bit for bit."""
    script = tmp_path / "train.py"
    script.write_text(MODEL_RETURNS_LOSS)
    out = tmp_path / "run"
    run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    first = report["first_nonfinite"]
    got = {k: first.get(k) for k in ("step", "phase", "module", "samples", "reproduced")}
    assert got == {"step": 4, "phase": "backward", "module": "", "samples": [6],
                   "reproduced": True}, first
    assert report["run"]["replay"] == {"status": "in-process", "step": 4}


KEYWORDS_ONLY = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
    def forward(self, features=None, labels=None):
        return {"loss": F.mse_loss(self.lin(features), labels)}
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(6):
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    if step == 3:
        x[5, 2] = float("nan")
    loss = model(features=x, labels=y)["loss"]
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_model_called_by_keywords_hands_its_batch_to_the_guard(tmp_path: Path) -> None:
    """`model(features=x, labels=y)` (the transformers style, no positional argument): the
    keyword tensors are the step's batch, so a NaN row is named from the batch itself, with no
    re-run (budget 0): phase data, sample 5, cause data_nonfinite."""
    script = tmp_path / "train.py"
    script.write_text(KEYWORDS_ONLY)
    out = tmp_path / "run"
    run(RunOptions(script=str(script), out=str(out), replay_budget=0, summary=False))
    report = json.loads((out / "report.json").read_text())
    first = report["first_nonfinite"]
    assert {k: first.get(k) for k in ("step", "phase", "samples")} == {
        "step": 3, "phase": "data", "samples": [5]}, first
    assert report["diagnosis"][0]["cause"] == "data_nonfinite", report["diagnosis"]
