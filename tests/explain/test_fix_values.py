"""Fixes a user would type (shared/DESIGN.md section 10): every value a fix proposes is one
that optimizer trains with, differs from the run's own, and is written in the script's flag
when a flag set it; an exp of a log-variance gets a clamp, not a softmax's shift.

The runs are real: a small regression script with argparse flags and a DataLoader, run under
`nanguard run` (in this process) with the fault given through a flag. What each run did is
established without nanguard: the script prints its own loss and, in the VAE, the largest
log-variance when its `exp(0.5 * log_var)` overflows. The plausible LRs are the usual
starting points of each optimizer (Adam 1e-4 to 1e-3, SGD 1e-3 to 1e-1), written here, not
read from nanguard.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import nanguard
from nanguard.config import GuardConfig, RecordConfig
from nanguard.explain import Evidence
from nanguard.explain import rules as R
from nanguard.explain.fixes import find_flag, lr_range, lr_typo, number, plausible_lr
from nanguard.run.runner import RunOptions, run

SCRIPT = '''
import argparse, torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
p = argparse.ArgumentParser()
p.add_argument("--learning_rate", "--lr", dest="lr", type=float, default=1e-3)
p.add_argument("--optim", default="adam", choices=["adam", "adamw", "sgd"])
p.add_argument("--model", default="mlp", choices=["mlp", "vae"])
p.add_argument("--clip", type=float, default=0.0)
p.add_argument("--epochs", type=int, default=3)
a = p.parse_args()
torch.manual_seed(0)

class VAE(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc, self.mu, self.lv = nn.Linear(16, 32), nn.Linear(32, 4), nn.Linear(32, 4)
        self.dec = nn.Linear(4, 16)

    def forward(self, x):
        h = torch.relu(self.enc(x))
        mu, log_var = self.mu(h), self.lv(h)
        std = torch.exp(0.5 * log_var)
        if not torch.isfinite(std).all():
            print(f"std overflow: log_var max {log_var.max().item():.4g}", flush=True)
        return self.dec(mu + std * torch.randn_like(std)), mu, log_var

model = VAE() if a.model == "vae" else nn.Sequential(
    nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
make = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
opt = make[a.optim](model.parameters(), lr=a.lr)
g = torch.Generator().manual_seed(1)
x = torch.randn(256, 16, generator=g)
y = x @ torch.randn(16, 1, generator=g)
loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)
step = 0
for epoch in range(a.epochs):
    for xb, yb in loader:
        if a.model == "vae":
            rec, mu, lv = model(xb)
            kl = -0.5 * (1 + lv - mu.pow(2) - lv.exp()).sum(1).mean()
            loss = F.mse_loss(rec, xb) + kl
        else:
            loss = F.mse_loss(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        if a.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        print(f"step {step} loss {loss.item():.6g}", flush=True)
        step += 1
'''

PLAUSIBLE = {"Adam": (1e-4, 1e-3), "AdamW": (1e-4, 1e-3), "SGD": (1e-3, 1e-1)}
"""Where a proposed LR should land: the usual starting points, not nanguard's table."""


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    optimizer: str
    flag: str
    """The LR flag as given on the command line, which the fix must name."""
    lr: float
    """The LR the run had (from its flag)."""
    typo: str | None = None
    """The value a typo reading proposes, as the user would type it."""


CASES = [
    Case("adam_typo", ("--learning_rate", "1e3"), "Adam", "--learning_rate", 1e3, "1e-3"),
    Case("sgd_typo", ("--optim", "sgd", "--lr", "1e3"), "SGD", "--lr", 1e3, "1e-3"),
    Case("vae_adam_at_1", ("--model", "vae", "--lr", "1", "--epochs", "1"), "Adam", "--lr", 1.0),
    Case("adamw_flag", ("--optim", "adamw", "--lr=5"), "AdamW", "--lr", 5.0),
    Case("vae_log_var", ("--model", "vae", "--lr", "3", "--epochs", "1"), "Adam", "--lr", 3.0),
]

_PROPOSAL = re.compile(r"(?:did you mean|->) `(--[\w-]+)[ =]([0-9.e+-]+)`")


def _nanguard_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                  args: tuple[str, ...], pinpoint: bool = False) -> tuple[dict, str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    # `pinpoint`: the op is needed (the log-variance); the LR fix does without the re-run
    # that pinpoints it (it runs the whole script again: seconds).
    run(RunOptions(script=str(script), args=list(args), out=str(out), summary=False,
                   fork_every=0, replay_budget=120 if pinpoint else 0))
    return json.loads((out / "report.json").read_text()), capsys.readouterr().out


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_proposed_lr_is_one_a_user_would_type(
        case: Case, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report, printed = _nanguard_run(tmp_path, capsys, case.args,
                                    pinpoint=case.name == "vae_log_var")
    # The script's own prints: the loss ran away (or went non-finite) within the run.
    losses = [float(v) for v in re.findall(r"^step \d+ loss (\S+)$", printed, re.M)]
    assert losses and (not all(map(math.isfinite, losses)) or max(losses) > 10 * losses[0]), \
        losses
    lr_fix = next(d for d in report["diagnosis"] if d["cause"] == "optimizer_divergence")
    found = _PROPOSAL.search(lr_fix["fix"])
    assert found is not None, lr_fix["fix"]  # in the script's flag, as the user typed it
    flag, text = found.groups()
    assert flag == case.flag, lr_fix["fix"]
    proposed = float(text)
    lo, hi = PLAUSIBLE[case.optimizer]
    assert lo <= proposed <= hi, lr_fix["fix"]
    assert not math.isclose(proposed, case.lr), lr_fix["fix"]
    if case.typo is not None:
        assert text == case.typo and "did you mean" in lr_fix["fix"], lr_fix["fix"]
    if case.name == "vae_log_var":
        # The script's own print: exp(0.5 * log_var) overflowed (log_var > 2 * 88.7).
        top = float(re.search(r"std overflow: log_var max (\S+)", printed).group(1))  # type: ignore[union-attr]
        assert top > 2 * math.log(torch.finfo(torch.float32).max)
        exp = next(d for d in report["diagnosis"] if d["cause"] == "exp_overflow")
        assert "log_var.clamp(-30, 20)" in exp["fix"] and "subtract the max" not in \
            exp["fix"].replace('"subtract the max" does not apply', ""), exp["fix"]


def test_a_clip_the_script_has_is_never_proposed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """SGD typed at 1e3 with the script's own `--clip 1.0`: the fix reads the typo and says
    the clip already bounds the gradient; it never proposes clipping at 1.0."""
    report, _ = _nanguard_run(tmp_path, capsys, ("--optim", "sgd", "--lr", "1e3",
                                                 "--clip", "1.0"))
    fix = next(d for d in report["diagnosis"] if d["cause"] == "optimizer_divergence")["fix"]
    assert "did you mean `--lr 1e-3`?" in fix, fix
    assert "clip_grad_norm_(model.parameters(), 1.0)" not in fix and "`--clip 1" not in fix
    assert "already bounds" in fix, fix


def test_a_guard_in_the_users_code_reads_the_typo_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same typo with a `Guard` in the script (`python train.py --lr 1e3`): the guard
    records the script's command line, so the fix names its flag; without a flag, `lr=1e-3`."""
    def train(argv: list[str]) -> str:
        monkeypatch.setattr("sys.argv", ["train.py", *argv])
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e3)
        g = torch.Generator().manual_seed(1)
        w = torch.randn(16, 1, generator=g)
        with nanguard.Guard(model, opt, out="", config=GuardConfig(
                record=RecordConfig(summary=False))) as guard:
            for _ in range(20):
                x = torch.randn(32, 16, generator=g)
                loss = torch.nn.functional.mse_loss(model(x), x @ w)
                guard.watch(loss=loss)
                opt.zero_grad()
                loss.backward()
                opt.step()
        assert guard.report is not None
        return next(d["fix"] for d in guard.report.diagnosis
                    if d["cause"] == "optimizer_divergence")

    assert "did you mean `--lr 1e-3`? `--lr 1e3` is 1e6x Adam's" in train(["--lr", "1e3"])
    assert "did you mean lr=1e-3? lr=1000 is 1e6x Adam's" in train([])


# ---------------------------------------------------------------------- the parts, both sides


def test_lr_ranges_know_torchs_defaults() -> None:
    for name in ("Adam", "AdamW", "SGD", "NAdam", "RMSprop", "Adagrad", "Adadelta", "LBFGS"):
        default = inspect.signature(getattr(torch.optim, name)).parameters["lr"].default
        r = lr_range(name)
        assert r is not None and r.default == default, name
        assert r.usual[0] <= r.band[0] <= r.default <= r.band[1] <= r.usual[1], name


def test_lr_typo_reads_a_flipped_exponent_only_where_it_lands() -> None:
    assert lr_typo("Adam", 1e3) == 1e-3 and lr_typo("AdamW", 3e4) == 3e-4
    assert lr_typo("SGD", 1e3) == 1e-3
    assert lr_typo("Adam", 10.0) is None  # 1e4x the default: too large, but not a typo
    assert lr_typo("Adam", 1e7) is None  # 1e-7 is no Adam LR either
    assert lr_typo("SGD", 1e4) is None  # 1e-4 is below SGD's usual LRs
    assert lr_typo(None, 1e3) is None and lr_typo("MyOptimizer", 1e3) is None


@pytest.mark.parametrize("opt", ["Adam", "SGD", "RMSprop"])
@pytest.mark.parametrize("lr", [1e-4, 3e-3, 0.05, 1.0, 30.0])
@pytest.mark.parametrize("cut", [10.0, 1e3, 1e12])
def test_plausible_lr_is_below_the_runs_and_within_the_band(
        opt: str, lr: float, cut: float) -> None:
    target, why = plausible_lr(opt, lr, lr / cut)
    r = lr_range(opt)
    assert r is not None and target < lr
    if lr > r.band[1]:
        assert r.band[0] <= target <= r.band[1]
    else:
        assert target >= lr / 100 and (why != "" or target == lr / cut)
    assert (target == lr / cut) == (why == "")


def test_find_flag_names_the_scripts_flag() -> None:
    argv = ["--data", "x.csv", "--learning-rate=3e-4", "--epochs", "1000", "--wd", "0.1"]
    lr = find_flag(argv, "lr")
    assert lr is not None and (lr.name, lr.text, lr.eq) == ("--learning-rate", "3e-4", True)
    assert lr.set(3e-5) == "`--learning-rate=3e-5`"
    assert find_flag(argv, "weight_decay").now() == "`--wd 0.1`"  # type: ignore[union-attr]
    assert find_flag(argv, "eps") is None and find_flag(None, "lr") is None
    assert find_flag(["--optimizer.lr", "0.1"], "lr").name == "--optimizer.lr"  # type: ignore[union-attr]
    # By value alone: one flag holding it, not an integer count (`--epochs 1000`).
    assert find_flag(["--step-size", "0.03"], "lr", [0.03]).name == "--step-size"  # type: ignore[union-attr]
    assert find_flag(["--epochs", "1000"], "lr", [1000.0]) is None
    assert find_flag(["--a", "0.1", "--b", "0.1"], "lr", [0.1]) is None
    flips = {"1e3": "1e-3", "3E+4": "3e-4", "1000": "1e-3", "0.5": None}
    for text, flipped in flips.items():
        assert find_flag(["--lr", text], "lr").flipped() == flipped  # type: ignore[union-attr]
    assert [number(v) for v in (0.005, 1e-5, 100.0, 15.49)] == ["0.005", "1e-5", "100", "15.5"]


def test_eps_and_weight_decay_fixes_use_the_flag_and_a_new_value() -> None:
    first = {"step": 3, "phase": "optimizer", "param": "fc.weight"}
    eps = R.optimizer_state_nonfinite(Evidence(first_nonfinite=first, eps=0.0, optimizer="Adam",
                                               argv=["--adam_epsilon", "0"]))
    assert eps is not None and "`--adam_epsilon 0` -> `--adam_epsilon 1e-8`" in eps.fix
    history = [{"step": s, "loss": 1.0 + s, "grad_norm": 1.0, "lr": 3e-3} for s in range(6)]
    history.append({"step": 6, "loss": 1e4, "grad_norm": 1e3, "lr": 3e-3})
    wd = R.optimizer_divergence(Evidence(
        first_nonfinite={"step": 7, "phase": "forward", "op": "aten.mm"}, lr=3e-3,
        optimizer="AdamW", weight_decay=1e4, decoupled_decay=True, history=history,
        argv=["--weight-decay", "1e4"]))
    assert wd is not None and "`--weight-decay 1e4` -> `--weight-decay 0.1`" in wd.fix, wd.fix


def test_exp_of_a_softmax_logit_keeps_the_max_fix(tmp_path: Path) -> None:
    """The other side of the log-variance fix: an exp whose line names no log-scale."""
    src = tmp_path / "attn.py"
    src.write_text("w = scores.exp()\nstd = torch.exp(0.5 * log_var)\n")
    first = {"step": 2, "phase": "forward", "op": "aten.exp", "source": f"{src}:1",
             "inputs": [{"dtype": "float32", "min": -1.0, "max": 300.0}]}
    soft = R.exp_overflow(Evidence(first_nonfinite=first))
    assert soft is not None and "subtract the max" in soft.fix and "clamp" not in soft.fix
    scale = R.exp_overflow(Evidence(first_nonfinite={**first, "source": f"{src}:2"}))
    assert scale is not None and "`log_var = log_var.clamp(-30, 20)`" in scale.fix
    # The same line inside an installed library: the fix is at the user's call into it.
    lib = tmp_path / "venv" / "lib" / "site-packages" / "vaelib" / "layers.py"
    lib.parent.mkdir(parents=True)
    lib.write_text(src.read_text())
    inside = R.exp_overflow(Evidence(first_nonfinite={**first, "source": f"{lib}:2"}))
    assert inside is not None and "your code passes to vaelib" in inside.fix, inside.fix
    assert "log_var = log_var" not in inside.fix


def _sgd_diverging(lrs: list[float], argv: list[str]) -> Evidence:
    """SGD blowing up from its first update (grad norm 0.97 -> 2e3), at these LRs per step."""
    history = [{"step": s, "loss": loss, "grad_norm": g, "lr": lr} for s, (loss, g, lr) in
               enumerate(zip((4.8, 2.3e5, 5.2e12), (0.97, 2.0e3, math.inf), lrs, strict=True))]
    return Evidence(first_nonfinite={"step": 2, "phase": "backward", "op": "aten.mm"},
                    lr=lrs[-1], optimizer="SGD", history=history, argv=argv)


def test_lr_flag_under_a_schedule_and_a_flag_the_lr_is_not() -> None:
    # A warm-up moved the LR from 0.1 to 0.5 (the flag, its peak): the flag is set to the
    # bound every step must keep; never the typo reading of an LR the schedule made.
    warm = R.optimizer_divergence(_sgd_diverging([0.1, 0.3, 0.5], ["--lr", "0.5"]))
    assert warm is not None and "(`--lr 0.5` -> `--lr 0.001`:" in warm.fix, warm.fix
    assert "set --lr, your schedule's peak, to it" in warm.fix
    # A flag the optimizer's LR is not (a batch-size rule ran it at 4x; or another part's
    # LR): the fix names the optimizer's own LR, not a guess at how the flag maps to it.
    scaled = R.optimizer_divergence(_sgd_diverging([0.4] * 3, ["--lr", "0.1"]))
    assert scaled is not None and "(lr=0.4 -> lr=0.001: 400x smaller" in scaled.fix
    assert "--lr" not in scaled.fix
    # Two LR flags (a one-cycle schedule's base and peak): the one holding the run's LR.
    both = find_flag(["--lr", "0.4", "--max-lr", "1.0"], "lr", [0.4])
    assert both is not None and both.name == "--lr"


def test_a_gaussian_kl_term_exps_a_log_variance(tmp_path: Path) -> None:
    src = tmp_path / "vae.py"
    src.write_text("kl = -0.5 * (1 + lv - mu.pow(2) - lv.exp()).sum(1).mean()\n"
                   "std = (h / 2).exp()\n")
    first = {"step": 2, "phase": "loss", "op": "aten.exp", "source": f"{src}:1",
             "inputs": [{"dtype": "float32", "min": -1.0, "max": 300.0}]}
    kl = R.exp_overflow(Evidence(first_nonfinite=first))
    assert kl is not None and "`lv = lv.clamp(-30, 20)`" in kl.fix
    half = R.exp_overflow(Evidence(first_nonfinite={**first, "source": f"{src}:2"}))
    assert half is not None and "`h = h.clamp(-30, 20)`" in half.fix


def test_the_clip_fix_never_repeats_the_scripts_clip() -> None:
    """Healthy grad norm 0.97: clipping at 3x is 2.91. A script that clips at 2.91 already
    (its `--clip` flag) is told its clip cannot fix the LR; one at 100 is told to lower it, in
    its flag."""
    ev = _sgd_diverging([0.5] * 3, ["--clip", "2.91"])
    same = R.optimizer_divergence(Evidence(**{**ev.__dict__, "clip": 2.91}))
    assert same is not None and "already bounds" in same.fix and "-> `--clip" not in same.fix
    loose = R.optimizer_divergence(Evidence(**{**ev.__dict__, "clip": 100.0,
                                               "argv": ["--clip", "100"]}))
    assert loose is not None and "your clip `--clip 100` is far above" in loose.fix
    assert "lower it to 2.91: `--clip 2.91`" in loose.fix, loose.fix
