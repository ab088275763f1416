"""Parity of the Lightning adapter with `Guard` on the project's scenario suite (tests/scenarios,
one root cause each): a scenario's model, optimizer and failing batch, trained for its one step
by a plain loop under `Guard(..., replay=...)` and by a real Lightning Trainer under
`NanguardCallback(replay=...)`, give the same first non-finite step, phase, module, op and
samples and the same top cause, and those are the scenario's EXPECTED ones.

The scenarios taken are those whose step is the plain `mse_step` and so fit a LightningModule as
they are (`training_step` = mse of the model's output): NaN in an input, Inf in a target, and
three model-internal causes (log of an underflowed sigmoid in the forward, sqrt at zero and a
custom autograd Function in the backward). The LightningModule adopts the scenario model's
children, so module names are the same in both runs."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("lightning")

from lightning_rig import pl, trainer  # noqa: E402

from nanguard import Guard, GuardConfig, RecordConfig  # noqa: E402
from nanguard.integrations.lightning import NanguardCallback  # noqa: E402
from scenarios import load  # noqa: E402

QUIET = GuardConfig(record=RecordConfig(summary=False))
NAMES = ["data_nan_input", "data_inf_target", "log_sigmoid_underflow", "sqrt_zero",
         "custom_function"]
KEYS = ("step", "phase", "module", "op", "samples")


def _loss(model: nn.Module, batch: Any) -> torch.Tensor:
    *xs, y = batch
    return nn.functional.mse_loss(model(*xs), y)


class Scenario(pl.LightningModule):
    """A scenario as a LightningModule: the model's children are its own (same names), its
    forward is the model's, its optimizer the scenario's."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        assert not list(model.parameters(recurse=False))
        self._model = [model]  # not a submodule: its children are already ours
        self._optimizer = optimizer

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return self._model[0](*xs)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return _loss(self, batch)

    def configure_optimizers(self) -> Any:
        return self._optimizer


def _plain(name: str, out) -> dict[str, Any]:
    b = load(name).build()
    guard = Guard(b.model, b.optimizer, out=out, config=QUIET,
                  replay=lambda batch: _loss(b.model, batch))
    loss = _loss(b.model, b.batch)
    guard.watch(loss=loss, batch=b.batch)
    b.optimizer.zero_grad()
    loss.backward()
    b.optimizer.step()
    return guard.close().to_dict()


def _lightning(name: str, out) -> dict[str, Any]:
    b = load(name).build()
    module = Scenario(b.model, b.optimizer)
    cb = NanguardCallback(out=out, config=QUIET, replay=lambda batch: _loss(module, batch))
    once = DataLoader([b.batch], batch_size=None)  # the scenario's batch, as it is, once
    trainer([cb], max_steps=1).fit(module, once)
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_lightning_finds_what_guard_finds(tmp_path, name):
    expected = load(name).EXPECTED
    plain = _plain(name, tmp_path / "plain")
    light = _lightning(name, tmp_path / "light")
    assert light["run"]["entry"] == "lightning"
    first, want = light["first_nonfinite"], plain["first_nonfinite"]
    assert first is not None and want is not None
    assert {k: first.get(k) for k in KEYS} == {k: want.get(k) for k in KEYS}
    assert light["diagnosis"][0]["cause"] == plain["diagnosis"][0]["cause"]
    # ... and both are the scenario's own answer
    assert (first["step"], first["phase"], first["module"], first["op"]) == (
        0, expected["phase"], expected["module"], expected["op"])
    assert first["samples"] == expected["samples"]
    assert light["diagnosis"][0]["cause"] == expected["cause"]
