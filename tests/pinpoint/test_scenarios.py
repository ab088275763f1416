"""Every scenario of the suite: the checker names the expected phase, module, op (and samples,
node, parameter where the scenario says), with and without the batch; healthy runs report
nothing. Also the replay of each failing step reproduces it bit for bit."""

import json

import pytest
import torch

from nanguard.pinpoint import StepSnapshot, find_origin, replay_step, step_fingerprint
from scenarios import HEALTHY, SCENARIOS, load

CAUSES = {"data_nonfinite", "label_nonfinite", "log_of_nonpositive", "division_by_zero",
          "singular_gradient", "masked_softmax", "exp_overflow", "low_precision_overflow",
          "optimizer_divergence", "exploding_init", "saturated_loss", "optimizer_state_nonfinite"}


def _optimizers(b):  # type: ignore[no-untyped-def]
    return b.notes.get("optimizers", b.optimizer)


def _check(origin, expected):  # type: ignore[no-untyped-def]
    if expected["phase"] is None:
        assert origin is None, origin
        return
    assert origin is not None
    got = (origin.phase, origin.module, origin.op)
    assert got == (expected["phase"], expected["module"], expected["op"]), origin
    if expected["samples"] is not None:
        assert origin.samples == expected["samples"]
    for key in ("node", "param"):
        if key in expected:
            assert getattr(origin, key) == expected[key]
    json.dumps(origin.to_dict())  # JSON-safe


@pytest.mark.parametrize("name", SCENARIOS + HEALTHY)
@pytest.mark.parametrize("with_batch", [True, False])
def test_scenario(name: str, with_batch: bool) -> None:
    mod = load(name)
    b = mod.build()
    if b.skip:
        pytest.skip(b.skip)
    origin = find_origin(b.step, model=b.model, optimizer=_optimizers(b),
                         batch=b.batch if with_batch else None)
    _check(origin, mod.EXPECTED)
    if origin is not None:
        assert mod.EXPECTED["cause"] in CAUSES
        assert origin.source is not None


@pytest.mark.parametrize("name", [n for n in SCENARIOS if n != "gan_bce"])
def test_replay_reproduces(name: str) -> None:
    mod = load(name)
    b = mod.build()
    if b.skip:
        pytest.skip(b.skip)
    snap = StepSnapshot.capture(b.model, b.optimizer)
    loss = b.step()  # the original run, unchecked
    fp = step_fingerprint(b.model, loss)
    origin = replay_step(b.step, model=b.model, optimizer=b.optimizer, snapshot=snap,
                         batch=b.batch, fingerprint=fp, step=7)
    _check(origin, mod.EXPECTED)
    assert origin is not None and origin.reproduced is True and origin.step == 7


def test_exploding_init_names_the_first_overflowing_layer() -> None:
    """Independent check with plain forward hooks: the first Linear with a non-finite output."""
    b = load("exploding_init").build()
    bad: list[str] = []
    hooks = [m.register_forward_hook(
        lambda m, i, o, n=n: bad.append(n) if not torch.isfinite(o).all() else None)
        for n, m in b.model.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        b.model(b.batch[0])
    for h in hooks:
        h.remove()
    assert bad and bad[0] == load("exploding_init").EXPECTED["module"]
