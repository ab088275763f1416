"""`nanguard run` on the step boundaries and endings real scripts have: hand-written updates
(no optimizer), LBFGS closures in float64, a script error that follows a NaN (BCE's range
check, `torch.multinomial`, `clip_grad_norm_(error_if_nonfinite=True)`), a NaN before any
update, Hogwild workers and DataLoader workers, SIGTERM, gradient accumulation with a real
optimizer (never watched twice), the merged summary of a GAN, a model input computed in the
step (not bad data) and a script that ends by `os._exit`. Several optimizers in one script:
test_run_optimizers.py.

The runner runs in this process (`runner.run`, what `nanguard run` calls, with the closing
summary on), its output read with capsys: a subprocess per run cost an interpreter start and a
torch import each. Only what needs a process of its own runs as one: `os._exit` (the command
then exits the hard way itself) and Hogwild's worker processes."""

from __future__ import annotations

import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from _run import EXAMPLES, nanguard_run, report

from nanguard.run.runner import RunOptions, run


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run_here(capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> Callable[..., Ran]:
    """`nanguard run --out OUT SCRIPT ARGS` in this process, from OUT's parent folder (as the
    subprocesses ran): its exit code and what it and the script printed."""

    def go(out: Path, script: Path, *args: str, policy: str = "observe") -> Ran:
        monkeypatch.chdir(out.parent)
        capsys.readouterr()  # what came before is not this run's
        rc = run(RunOptions(script=str(script), args=list(args), out=str(out), policy=policy))
        captured = capsys.readouterr()
        return Ran(rc, captured.out, captured.err)

    return go

MANUAL_SGD = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
lr = 0.05
for step in range(6):
    x = torch.randn(16, 4)
    if step == 2 and "--poison" in __import__("sys").argv:
        x[5, 1] = float("nan")
    model.zero_grad()
    loss = (model(x) - 1).pow(2).mean()
    loss.backward()
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-lr)
print("done")
"""


def test_manual_sgd_is_watched_and_stopped_at_its_third_batch(tmp_path: Path) -> None:
    # Subprocesses: the exit code and stdout of a whole `nanguard run` (an in-process run of
    # hand-written updates is test_a_manual_step_run_leaves_no_mode_behind below).
    script = tmp_path / "manual.py"
    script.write_text(MANUAL_SGD)
    healthy = tmp_path / "healthy"
    r = nanguard_run(healthy, script)
    assert r.returncode == 0, r.stderr
    rep = report(healthy)
    assert (rep["status"], rep["steps"]) == ("healthy", 6)  # one step per backward

    out = tmp_path / "poisoned"
    r = nanguard_run(out, script, "--poison", options=("--policy", "raise"))
    assert r.returncode == 1, r.stderr
    assert "done" not in r.stdout  # stopped
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 2
    assert (first["step"], first["phase"], first["samples"]) == (2, "data", [5])
    assert rep["run"]["replay"]["status"] == "found"  # the re-run counted the same boundaries
    assert first["source"].endswith("manual.py:11") and first["reproduced"] is True


def test_a_manual_step_run_leaves_no_mode_behind(tmp_path: Path) -> None:
    """An in-process run (runner.run, a notebook) removes what it installed: a mode left
    behind wraps every later torch call of the process (the next run there then calls the
    script's own `binary_cross_entropy` error "a nanguard bug")."""
    script = tmp_path / "manual.py"
    script.write_text(MANUAL_SGD)
    before = torch._C._len_torch_function_stack()
    try:
        assert run(RunOptions(script=str(script), out=str(tmp_path / "r"), summary=False)) == 0
        assert torch._C._len_torch_function_stack() == before
    finally:
        while torch._C._len_torch_function_stack() > before:  # the rest of this process
            torch._C._pop_torch_function_stack()


RAW_TENSORS = """
import torch
torch.manual_seed(0)
W = torch.zeros(3, 1, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
true_w = torch.tensor([[1.0], [-2.0], [0.5]])
for step in range(5):
    x = torch.randn(8, 3)
    y = x @ true_w
    if step == 3:
        x[6, 2] = float("inf")
    loss = ((x @ W + b - y) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        W -= 0.1 * W.grad
        b -= 0.1 * b.grad
        W.grad.zero_()
        b.grad.zero_()
"""


def test_raw_tensors_updated_by_hand(tmp_path: Path) -> None:
    script = tmp_path / "raw.py"
    script.write_text(RAW_TENSORS)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), summary=False))
    assert rc == 1
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 5
    assert (first["step"], first["kind"], first["samples"]) == (3, "input", [6])
    # The line where the batch enters the computation (`loss = ((x @ W + b - y) ** 2)...`),
    # not the `backward()` line after it: the re-run's checker is armed before step 3's
    # forward, although a hand-written step ends only at the next backward.
    assert first["source"].endswith("raw.py:12")
    assert first["reproduced"] is True  # the re-run's loss at step 3 is the recorded one


ACCUMULATION = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(4):
    for micro in range(3):
        model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_real_optimizer_with_accumulation_is_not_watched_twice(tmp_path: Path) -> None:
    script = tmp_path / "accum.py"
    script.write_text(ACCUMULATION)
    out = tmp_path / "run"
    assert run(RunOptions(script=str(script), out=str(out), summary=False)) == 0
    rep = report(out)
    assert (rep["status"], rep["steps"]) == ("healthy", 4)
    assert "parts" not in rep["run"]  # one optimizer, no ManualStep beside it


LBFGS = """
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Linear(3, 1).double()
opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
x = torch.randn(32, 3, dtype=torch.float64)
y = x @ torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)
for step in range(5):
    if step == 3 and sys.argv[1:] == ["--poison"]:
        x[4, 0] = float("nan")

    def closure():
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
print("done")
"""


def test_lbfgs_closure_float64(tmp_path: Path, run_here: Callable[..., Ran],
                               capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "lbfgs.py"
    script.write_text(LBFGS)
    healthy = tmp_path / "healthy"
    r = run_here(healthy, script)
    assert r.returncode == 0, r.stderr
    rep = report(healthy)
    assert (rep["status"], rep["steps"]) == ("healthy", 5)
    monkeypatch.setattr(sys, "argv", [str(script)])
    runpy.run_path(str(script), run_name="__main__")  # the script alone prints the same
    assert r.stdout == capsys.readouterr().out == "done\n"

    bad = tmp_path / "poisoned"
    r = run_here(bad, script, "--poison")
    assert r.returncode == 1, r.stderr
    rep = report(bad)
    first = rep["first_nonfinite"]
    # The closure's gradients were checked at the step that made them, and the re-run gave
    # the closure's ops their own phase, not `optimizer`.
    assert (first["step"], first["phase"], first["samples"]) == (3, "data", [4])
    assert "loss" in first["signals"]
    assert rep["run"]["replay"]["status"] == "found"
    assert first["propagated_by"]["phase"] == "forward"
    assert first["source"].endswith("lbfgs.py:15")


BCE_AFTER_NAN = """
import torch
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1), torch.nn.Sigmoid())
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(8, 3)
    y = (x[:, :1] > 0).float()
    if step == 3:
        x[2, 1] = float("nan")
    loss = F.binary_cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_bce_error_after_a_nan_is_a_numerical_failure(
        tmp_path: Path, run_here: Callable[..., Ran]) -> None:
    script = tmp_path / "bce.py"
    script.write_text(BCE_AFTER_NAN)
    out = tmp_path / "run"
    r = run_here(out, script)
    assert r.returncode == 1
    assert "all elements of input should be between 0 and 1" in r.stderr
    assert "bce.py failed with an error after non-finite values appeared" in r.stderr
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 3
    assert (first["step"], first["phase"], first["samples"]) == (3, "data", [2])
    assert rep["run"]["replay"]["status"] == "found"
    assert rep["run"]["script"]["outcome"] == "error"


MULTINOMIAL = """
import torch
torch.manual_seed(0)
policy = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
opt = torch.optim.SGD(policy.parameters(), lr=0.01)
for episode in range(6):
    state = torch.randn(5, 4)
    if episode == 4:
        state[1, 3] = float("inf")
    probs = torch.softmax(policy(state), dim=-1)
    actions = torch.multinomial(probs, 1)
    loss = -(torch.log(probs.gather(1, actions)) * torch.randn(5, 1)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_multinomial_error_after_a_nan(tmp_path: Path) -> None:
    script = tmp_path / "pg.py"
    script.write_text(MULTINOMIAL)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), summary=False))
    assert rc == 1
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 4
    assert (first["step"], first["phase"], first["samples"]) == (4, "data", [1])
    assert rep["run"]["script"]["nonfinite_before_end"]


FIRST_BATCH = """
import torch
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 3)
x[2, 0] = float("nan")
out = model(x)
loss = out.pow(2).mean()
if torch.isnan(loss):
    raise SystemExit("loss is nan at the first batch")
loss.backward()
opt.step()
"""


def test_nan_before_any_update_is_not_healthy(tmp_path: Path,
                                             run_here: Callable[..., Ran]) -> None:
    script = tmp_path / "first.py"
    script.write_text(FIRST_BATCH)
    out = tmp_path / "run"
    r = run_here(out, script)
    assert r.returncode == 1  # the script's own exit code
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["steps"] == 0
    assert (first["step"], first["phase"], first["samples"]) == (0, "data", [2])
    assert "failed: non-finite at step 0, before any update" in r.stderr


HOGWILD = """
import torch
import torch.multiprocessing as mp

def train(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()

if __name__ == "__main__":
    model = torch.nn.Linear(3, 1)
    model.share_memory()
    workers = [mp.Process(target=train, args=(model,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print("exit codes", [w.exitcode for w in workers])
"""


def test_hogwild_workers_are_unwatched_never_healthy(tmp_path: Path) -> None:
    script = tmp_path / "hogwild.py"
    script.write_text(HOGWILD)
    out = tmp_path / "run"
    r = nanguard_run(out, script)
    assert "exit codes [0, 0]" in r.stdout, r.stderr
    assert r.returncode == 1
    rep = report(out)
    assert rep["status"] == "unwatched" and rep["steps"] == 0
    assert "started 2 worker process(es)" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["report.json"]  # workers recorded nothing


SLOW = """
import os
import signal
import sys
import time
import torch
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10_000):
    x = torch.randn(4, 3)
    if step == 2 and sys.argv[1:] == ["--poison"]:
        x[1, 1] = float("nan")
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step == 4:
        print("started", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's time limit, mid-training
    time.sleep(0.05)
print("never reached")
"""


def test_sigterm_writes_an_honest_report(tmp_path: Path,
                                         run_here: Callable[..., Ran]) -> None:
    """SIGTERM while the script trains (the process signals itself at step 4, as a
    scheduler would from outside): the script unwinds, the report says interrupted."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW)
    out = tmp_path / "run"
    r = run_here(out, script)
    assert r.returncode == 143 and "started" in r.stdout and "never reached" not in r.stdout
    rep = report(out)
    assert rep["status"] == "interrupted" and rep["steps"] == 5
    assert rep["run"]["script"]["message"] == "SIGTERM"

    bad = tmp_path / "poisoned"
    r = run_here(bad, script, "--poison")
    assert r.returncode == 143
    rep = report(bad)
    assert rep["status"] == "failed" and rep["first_nonfinite"]["step"] == 2
    assert rep["run"]["replay"]["status"] == "skipped"


def test_gan_merged_summary_shows_source_and_every_part(
        tmp_path: Path, run_here: Callable[..., Ran]) -> None:
    out = tmp_path / "gan"
    r = run_here(out, EXAMPLES / "gan_two_optimizers.py", "--steps", "20",
                 "--poison-step", "12")
    assert r.returncode == 1, r.stderr
    assert "gan_two_optimizers.py:45" in r.stderr  # the origin's source line
    assert "optimizer-0 (" in r.stderr and "optimizer-1 (" in r.stderr  # a table per part
    merged = json.loads((out / "report.json").read_text())
    assert merged["first_nonfinite"]["reproduced"] is True


MASKED_CLIP = """
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
keep = torch.ones(64, 6, dtype=torch.bool)
keep[3] = False  # sample 3 is all padding: every score of its row is masked to -inf
dl = DataLoader(TensorDataset(torch.randn(64, 6, 4), keep, torch.randn(64, 1)), batch_size=8,
                num_workers=2 if "--exit" in sys.argv else 0)
score = torch.nn.Linear(4, 1)
head = torch.nn.Linear(4, 1)
model = torch.nn.ModuleList([score, head])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for x, k, y in dl:
    if "--exit" in sys.argv:
        raise SystemExit("no labels configured")
    s = score(x).squeeze(-1).masked_fill(~k, float("-inf"))
    pooled = (s.softmax(-1).unsqueeze(-1) * x).sum(1)
    loss = (head(pooled) - y).pow(2).nanmean()  # the script's own NaN-tolerant loss
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    opt.step()
"""


def test_clip_error_after_a_nan_is_the_scripts_not_nanguards(
        tmp_path: Path, run_here: Callable[..., Ran]) -> None:
    """`clip_grad_norm_(error_if_nonfinite=True)` raising through nanguard run's wrapper of it
    is the script's numerical failure (it was called "a nanguard bug", the run `unwatched`);
    a DataLoader's worker processes are not "training inside worker processes"."""
    script = tmp_path / "masked.py"
    script.write_text(MASKED_CLIP)
    out = tmp_path / "run"
    r = run_here(out, script)
    assert r.returncode == 1
    assert "nanguard bug" not in r.stderr and "error_if_nonfinite" in r.stderr
    rep = report(out)
    first = rep["first_nonfinite"]
    assert rep["status"] == "failed" and rep["run"]["script"]["outcome"] == "error"
    # The softmax is the script's own code between two modules: the loss phase, no module
    # (not `Linear`, whose output held the NaN at the end), the script's line.
    assert (first["step"], first["phase"], first["samples"]) == (0, "loss", [3])
    line = MASKED_CLIP.splitlines().index(
        "    pooled = (s.softmax(-1).unsqueeze(-1) * x).sum(1)")
    assert (first["op"], first["module"], first["source"]) == (
        "aten._softmax", None, f"masked.py:{line + 1}")
    assert rep["diagnosis"][0]["cause"] == "masked_softmax"
    early = tmp_path / "early"
    r = run_here(early, script, "--exit")
    assert r.returncode == 1 and report(early)["status"] == "unwatched"
    assert "worker process" not in r.stderr, r.stderr


STANDARDISED_IN_STEP = """
import torch
from torch import nn
torch.manual_seed(0)
X = torch.randn(320, 6)
X[192:256, 2] = 1.0  # batch 3: feature 2 stuck at one value (its std is 0)
Y = X[:, :1].clone()
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(5):
    x, y = X[step * 64:(step + 1) * 64], Y[step * 64:(step + 1) * 64]
    x = (x - x.mean(0)) / x.std(0)  # per-batch standardisation
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_model_input_computed_in_the_step_is_not_called_bad_data(tmp_path: Path) -> None:
    """The data holds no NaN (checked below); the script's own standardisation divides by a
    zero std at step 3. The model input holds NaN, but it was made in the step: the cause is
    the division at that line, not "repair those rows at load time"."""
    ns: dict[str, object] = {}
    exec(STANDARDISED_IN_STEP.split("model =")[0], ns)  # the data, as the script builds it
    assert bool(torch.isfinite(ns["X"]).all())  # type: ignore[call-overload]
    script = tmp_path / "std.py"
    script.write_text(STANDARDISED_IN_STEP)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), out=str(out), summary=False))
    assert rc == 1
    rep = report(out)
    first = rep["first_nonfinite"]
    line = STANDARDISED_IN_STEP.splitlines().index(
        "    x = (x - x.mean(0)) / x.std(0)  # per-batch standardisation")
    assert (first["step"], first["op"]) == (3, "aten.div")
    assert first["source"].endswith(f"std.py:{line + 1}")
    assert rep["diagnosis"][0]["cause"] == "division_by_zero", rep["diagnosis"]


OS_EXIT = """
import os
import sys
import torch
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
X = torch.randn(96, 4)
if "--poison" in sys.argv:
    X[70, 1] = float("nan")  # batch 2 (rows 64..95), sample 6
dl = DataLoader(TensorDataset(X), batch_size=32, num_workers=2)  # workers end by os._exit
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for (x,) in dl:
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("training done", flush=True)
os._exit(3 if "--poison" in sys.argv else 0)  # skip the interpreter's teardown
"""


def test_os_exit_at_the_end_still_writes_the_report(tmp_path: Path) -> None:
    """A script that ends by `os._exit` (to skip the interpreter's teardown) used to leave no
    report.json, no summary and exit 0 after a NaN: its main thread's `os._exit` now unwinds
    the script, the record is written, and `nanguard run` exits the same hard way with the
    script's code; the DataLoader workers' own `os._exit` is theirs."""
    script = tmp_path / "hard.py"
    script.write_text(OS_EXIT)
    bad = tmp_path / "bad"
    r = nanguard_run(bad, script, "--poison")
    assert "training done" in r.stdout and r.returncode == 3, r.stderr
    rep = report(bad)
    assert rep["status"] == "failed" and rep["steps"] == 3
    assert (rep["first_nonfinite"]["step"], rep["first_nonfinite"]["samples"]) == (2, [6])
    assert rep["run"]["script"]["os_exit"] is True
    assert "nanguard: failed after 3 steps" in r.stderr
