"""The summary printed when a run ends fits a screen: at most 25 lines at 80 columns, and still
names the status, the first non-finite value (step, phase, op, the user's line), the lead time
of the first warning, the cause and its fix, and the commands to run next. `nanguard report RUN
--full` prints the tables behind it; cut lists say how much they hold ("8 of 17"); the steps
shown say truthfully where they stop. Real tiny training on CPU: a cascade under the Guard API
(`guard.close()`), NaN rows in a batch under `nanguard run`, a run NaN from step 0, a healthy
run; what each should say is known from the script, not from nanguard."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from in_process import nanguard
from nanguard import Guard
from nanguard.cli.main import main
from nanguard.scenarios.cascade import train_cascade

WIDTH = 80
BUDGET = 25


def _closing(err: str, start: str = "nanguard: ") -> list[str]:
    """The summary: from its status line to the end of stderr, without the runner's own
    `nanguard run:` lines."""
    lines = err.splitlines()
    begin = max(i for i, x in enumerate(lines) if re.match(rf"{start}\w+( after|:)", x))
    return [x for x in lines[begin:] if not x.startswith("nanguard run:")]


def _fits(lines: list[str]) -> None:
    """At most BUDGET rows on a terminal WIDTH columns wide (a longer line takes several)."""
    rows = sum(max(1, -(-len(x) // WIDTH)) for x in lines)
    assert rows <= BUDGET, "\n".join(lines)


@pytest.fixture
def narrow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.chdir(tmp_path)  # run folders named as a user would: `run`


def test_a_cascade_closed_from_the_api(tmp_path: Path, narrow: None,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """The cascade's seed 0 warns at step 148 and is NaN from step 155 (its losses say so)."""
    out = Path("run")
    _, losses = train_cascade(0, lambda m, o: Guard(m, o, out=str(out)), steps=170)
    first_nan = next(i for i, v in enumerate(losses) if not torch.isfinite(torch.tensor(v)))
    assert first_nan == 155
    lines = _closing(capsys.readouterr().err)
    _fits(lines)
    text = "\n".join(lines)
    assert lines[0] == f"nanguard: failed after 170 steps — record in {out}"
    assert f"first non-finite at step {first_nan} (phase loss" in text
    assert "first warning at step 148: 7 steps before the first non-finite value" in text
    assert "cause: optimizer_divergence (" in text and "clip_grad_norm_" in text
    assert f"next: nanguard report {out} --html" in text
    assert f"nanguard report {out} --full" in text
    assert "nanguard replay" not in text  # an API run does not say how to run it again
    # The steps shown stop one after the first non-finite value, and say so.
    assert f"steps 133-{first_nan + 1}, up to the first non-finite ({first_nan})" in text

    # `nanguard report` says the same in as little; --full has the tables and every cause.
    assert main(["report", str(out)]) == 1
    again = capsys.readouterr().out.splitlines()
    _fits(again)
    assert again[0] == lines[0] and "cause: optimizer_divergence (" in "\n".join(again)
    assert main(["report", "--full", str(out)]) == 1
    full = capsys.readouterr().out
    assert "cause 1: optimizer_divergence" in full and "alarms" in full
    assert " step " in full and "loss" in full and len(full.splitlines()) > BUDGET


NAN_ROWS = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
rows = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
for step in range(12):
    x = torch.randn(64, 4); y = x.sum(1, keepdim=True)
    if step == {bad}:
        x[rows, 1] = float("nan")
    out = model(x)  # the first op to meet the NaN
    loss = nn.functional.mse_loss(out, y)
    opt.zero_grad(); loss.backward(); opt.step()
    print("step", step, "loss", loss.item())
"""


def _script(tmp_path: Path, bad: int) -> tuple[Path, int]:
    script = tmp_path / "train.py"
    source = NAN_ROWS.replace("{bad}", str(bad))
    script.write_text(source)
    line = 1 + source.splitlines().index(
        next(x for x in source.splitlines() if "the first op to meet" in x))
    return script, line


def test_nan_rows_under_nanguard_run(tmp_path: Path) -> None:
    """17 NaN rows at step 5: the summary names the step, the op, the script's line, the
    cause and its fix, and the replay to run; 8 of the 17 samples, saying so."""
    script, line = _script(tmp_path, bad=5)
    r = nanguard(["run", "--out", "run", str(script)], tmp_path)  # `main`, in this process
    assert r.returncode == 1, r.stderr
    printed = [ln for ln in r.stdout.splitlines() if ln.startswith("step ")]
    assert printed[5].endswith("nan") and not printed[4].endswith("nan")  # the script's own
    lines = _closing(r.stderr)
    _fits(lines)
    text = "\n".join(lines)
    assert lines[0].startswith("nanguard: failed after 12 steps")
    # The model's first module, a Linear (addmm), is the first op to meet the NaN rows.
    assert "first non-finite at step 5 (phase data, module 0, op aten.addmm)" in text
    assert "samples 2, 3, 5, 7, 11, 13, 17, 19 (8 of 17)" in text
    assert re.search(rf"\n    at \S*{script.name}:{line}\n", text), text
    assert "cause: data_nonfinite (" in text and "fix: " in text
    assert "no warning came before it" in text  # NaN rows come without a warning
    assert "nanguard replay run" in text and "nanguard report run --html" in text
    assert "up to the first non-finite (5)" in text


def _train(out: Path, steps: int, nan_from: int | None = None, nan_until: int = 10**9,
           policy: str = "observe") -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Guard(model, opt, out=str(out), policy=policy) as guard:
        for step in range(steps):
            x = torch.randn(32, 4)
            if nan_from is not None and nan_from <= step < nan_until:
                x[3, 1] = float("nan")
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            guard.watch(loss=loss, batch=x)
            opt.zero_grad()
            loss.backward()
            opt.step()


def test_nan_from_step_0_is_not_a_spike(narrow: None, capsys: pytest.CaptureFixture[str]
                                        ) -> None:
    """Non-finite from the first step on: no "100.0% of steps in spike"; skipped by the
    `skip` policy (NaN rows in the first 3 batches only), no "spike score 100.0%" either: the
    score rests on those 3 non-finite steps alone."""
    _train(Path("run"), 20, nan_from=0)
    lines = _closing(capsys.readouterr().err)
    _fits(lines)
    text = "\n".join(lines)
    assert "first non-finite at step 0" in text and "in spike" not in text
    assert "steps 0-1, up to the first non-finite (0)" in text
    _train(Path("skip"), 20, nan_from=0, nan_until=3, policy="skip")
    text = "\n".join(_closing(capsys.readouterr().err))
    assert "recovered after 20 steps" in text and "100.0%" not in text
    assert "spikes: 1 episode, 15.0% of steps in spike" in text  # 3 of 20 steps


def test_a_healthy_run_is_short(tmp_path: Path, narrow: None,
                                capsys: pytest.CaptureFixture[str]) -> None:
    out = Path("run")
    _train(out, 30)
    lines = _closing(capsys.readouterr().err)
    _fits(lines)
    text = "\n".join(lines)
    assert lines[0] == f"nanguard: healthy after 30 steps — record in {out}"
    assert "the last 24 steps (6-29)" in text and "first non-finite" not in text
    assert "cause:" not in text and "replay" not in text
    assert f"next: nanguard report {out} --html" in text
