"""A mistake on the command line is one line in one wording, exit 2: argparse's own (`nanguard
run: error: ... (see nanguard run --help)`, no usage block) for every subcommand, and the
commands' own checks: a directory given as the script, a negative --replay-budget, an --out that
already holds a run (refused as `Guard(out=...)` refuses, unless --overwrite, which replaces it
whole). The preflight's verdict counts problems, as it lists them, not layers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from nanguard import Guard
from nanguard.cli.main import COMMANDS, main

ONE_LINE = re.compile(r"nanguard (\w+): error: (.+)")


def _one_line(err: str) -> tuple[str, str]:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1, err
    m = ONE_LINE.fullmatch(lines[0])
    assert m, lines[0]
    return m.group(1), m.group(2)


@pytest.mark.parametrize("name", COMMANDS)
def test_argparse_mistakes_are_one_line(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main([name, "--no-such-flag", "x"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    command, message = _one_line(err)
    assert command == name and message.endswith(f"(see nanguard {name} --help)"), err
    assert "usage:" not in err


def test_bad_values_name_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, says in ((["run", "--policy", "nope", "t.py"], "argument --policy: invalid choice"),
                       (["run", "--replay-budget", "soon", "t.py"], "invalid float value"),
                       (["export", "r"], "required: --to"),
                       (["run"], "arguments are required: script (")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2
        command, message = _one_line(capsys.readouterr().err)
        assert command == argv[0] and says in message, message


def test_run_checks_its_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "adir").mkdir()
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    for argv, says in (([str(tmp_path / "adir")], "is a directory, not a script"),
                       (["--replay-budget", "-1", str(script)], "--replay-budget must be >= 0"),
                       ([str(tmp_path / "nope.py")], "no such script")):
        assert main(["run", *argv]) == 2
        captured = capsys.readouterr()
        assert says in _one_line(captured.err)[1] and "never run" not in captured.out


def _api_run(out: Path, steps: int) -> None:
    """A run recorded by the Guard API: the folder a later `nanguard run --out` meets."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, out=str(out))
    guard.config.record.summary = False
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()


SCRIPT = """
import torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print("trained")
"""


def test_out_holding_a_run_is_refused_unless_overwrite(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "run"
    _api_run(out, steps=7)
    (out / "optimizer-1").mkdir()  # as a run of two optimizers leaves it
    (out / "notes.txt").write_text("mine")  # not nanguard's: stays
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert main(["run", "--out", str(out), str(script)]) == 2
    captured = capsys.readouterr()
    message = _one_line(captured.err)[1]
    assert "already holds a run" in message and "--overwrite" in message
    assert "trained" not in captured.out
    assert json.loads((out / "report.json").read_text())["steps"] == 7  # untouched
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--out", str(out), "--overwrite", str(script)]) == 0
    assert "trained" in capsys.readouterr().out
    assert json.loads((out / "report.json").read_text())["steps"] == 3  # the new run alone
    assert not (out / "optimizer-1").exists() and (out / "notes.txt").read_text() == "mine"


def test_preflight_verdict_counts_problems_not_layers() -> None:
    """An MLP whose every Linear starts at std 1: one init problem over several layers."""
    from nanguard.audit.preflight import PreflightConfig, preflight
    from nanguard.audit.preflight_live import verdict_lines

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(256, 256), nn.ReLU())],
                          nn.Linear(256, 10))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=1.0)
    batch = (torch.randn(32, 256), torch.randint(0, 10, (32,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    report = preflight(model, batch, nn.functional.cross_entropy, opt,
                       config=PreflightConfig(overfit_steps=5, lr_steps=6))
    result = {"ran": True, "model": "Sequential", "loss": "cross_entropy",
              "optimizer": {"class": "SGD", "lr": 0.01}, **report.to_dict()}
    lines = verdict_lines(result)
    layers = [f for f in result["findings"] if f["code"] == "exploding_init"]
    assert len(layers) >= 3  # several layers ...
    listed = [x for x in lines if x.startswith("  error ")]
    assert sum(x.startswith("  error exploding_init:") for x in listed) == 1  # ... one line
    assert lines[-1].startswith(f"  verdict: {len(listed)} error-level finding(s)"), lines
