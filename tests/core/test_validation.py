"""Mistypes are refused at construction with a one-line ValueError that lists the valid names;
run folders never collide; a closed Guard is not silently reused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig, WatchConfig


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(3, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("build", "words"),
    [
        (lambda: GuardConfig(act_on=("nonfinit",)), ["'nonfinit'", "spike", "cascade"]),
        (lambda: GuardConfig(act_on="spike"), ["act_on=('spike',)"]),
        (lambda: GuardConfig(policy="skipp"), ["'skipp'", "rollback"]),
        (lambda: GuardConfig(polcy="skip"), ["'polcy'", "policy", "act_on"]),
        (lambda: WatchConfig(activation=True), ["'activation'", "activations"]),
        (lambda: RecordConfig(if_exists="append"), ["'append'", "resume"]),
        (lambda: nanguard.Guard(*_model_opt(), policy="stop", out=""), ["'stop'", "raise"]),
    ],
)
def test_mistypes_are_value_errors_listing_the_valid_names(build, words) -> None:
    with pytest.raises(ValueError) as info:
        build()
    message = str(info.value)
    assert "\n" not in message
    for w in words:
        assert w in message


def test_closed_guard_refuses_to_be_used_again(tmp_path: Path) -> None:
    model, opt = _model_opt()
    guard = nanguard.Guard(model, opt, out=tmp_path / "r")
    with guard:
        pass
    with pytest.raises(ValueError, match="closed"), guard:
        pass
    with pytest.raises(ValueError, match="closed"):
        guard.watch(loss=torch.tensor(1.0))


def test_default_folders_never_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    model, opt = _model_opt()
    guards = [nanguard.Guard(model, opt) for _ in range(3)]  # same second, same process
    folders = {g.folder for g in guards}
    assert len(folders) == 3
    for g in guards:
        g.close()
    assert all((f / "report.json").is_file() for f in folders if f is not None)


def test_an_existing_run_folder_is_refused_unless_asked(tmp_path: Path) -> None:
    model, opt = _model_opt()
    nanguard.Guard(model, opt, out=tmp_path / "r").close()
    with pytest.raises(ValueError, match="already holds a run"):
        nanguard.Guard(model, opt, out=tmp_path / "r")
    cfg = GuardConfig(record=RecordConfig(if_exists="overwrite", summary=False))
    nanguard.Guard(model, opt, out=tmp_path / "r", config=cfg).close()
    assert not (tmp_path / "r" / "nanguard_error.txt").exists()
