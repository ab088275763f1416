"""The first non-finite step is exact, wherever the value sits, and loaded state is named.

Covers: Adam's `exp_avg_sq` overflowing to inf (it never reaches the parameters: the update
divides by its root) seen in the step it happens when the state is measured every step, at
the next sampled step or at close when it is sampled; a BatchNorm running variance at inf seen as
a `buffer_nonfinite` warning (training mode does not read it); a causal -inf mask buffer not
mistaken for one; a checkpoint with a NaN in its
optimizer state, loaded before or after the Guard was built, reported as phase `checkpoint`
with the tensor's name and the line that loaded it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard


def _steps(model: nn.Module, opt: torch.optim.Optimizer, guard: nanguard.Guard, n: int) -> None:
    g = torch.Generator().manual_seed(3)
    for _ in range(n):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean()
        guard.watch(loss=loss, batch=x)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _exp_avg_sq_overflow(tmp_path: Path, every: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    calls = {"n": 0}

    def overflow(*_: object) -> None:  # inside step 12's update: v_t overflows to inf
        calls["n"] += 1
        if calls["n"] == 13:
            opt.state[model[2].weight]["exp_avg_sq"][0, 0] = float("inf")

    opt.register_step_post_hook(overflow)  # registered first: runs before the guard's
    config = nanguard.GuardConfig(watch=nanguard.WatchConfig(sample_every=every))
    with nanguard.Guard(model, opt, out=tmp_path / "r", config=config) as guard:
        _steps(model, opt, guard, 20)
    for p in model.parameters():  # the parameters never went non-finite
        assert torch.isfinite(p).all()
    first = guard.first_nonfinite
    assert first is not None
    assert first["signals"] == ["optimizer.exp_avg_sq"]
    assert first["param"] == "2.weight"
    assert guard.report is not None and guard.report.status == "failed"
    return first


def test_exp_avg_sq_overflow_is_seen_in_its_step(tmp_path: Path) -> None:
    # The state measured every step: the step it went bad.
    assert _exp_avg_sq_overflow(tmp_path, every=1)["step"] == 12


@pytest.mark.parametrize(("every", "seen"), [(5, 15), (10, 19)])
def test_exp_avg_sq_overflow_is_seen_at_the_next_sample_or_at_close(
        tmp_path: Path, every: int, seen: int) -> None:
    # Sampled (DESIGN section 8): an inf `exp_avg_sq` leaves the parameters finite, so it is
    # seen at the next sampled step (15 for every 5), or at close when none comes (the 20
    # steps end at 19 before the sample at 20: the state is measured after the last step).
    assert _exp_avg_sq_overflow(tmp_path, every=every)["step"] == seen


def test_batchnorm_running_var_at_inf_is_seen(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    calls = {"n": 0}

    def blow_up(*_: object) -> None:  # step 4: an inf running variance (as a forward of
        calls["n"] += 1               # activations near 1e19 would write it)
        if calls["n"] == 5:
            model[1].running_var[3] = float("inf")

    opt.register_step_pre_hook(blow_up)  # registered first: runs before the guard's
    with nanguard.Guard(model, opt, out=tmp_path / "r") as guard:
        _steps(model, opt, guard, 8)
    # Training mode never reads the running variance: a warning at its step, not the first
    # failure (issue 37); the loss and every gradient stayed finite.
    assert guard.first_nonfinite is None
    warned = [(a.step, a.kind) for a in guard.alarms]
    assert warned == [(4, "buffer_nonfinite")], warned


class _Masked(nn.Module):
    """A causal mask buffer full of -inf: intended, never an alarm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x).unsqueeze(1) + self.mask).softmax(-1).sum(1)


def test_inf_mask_buffer_is_not_an_alarm(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Masked()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.Guard(model, opt, out=tmp_path / "r") as guard:
        _steps(model, opt, guard, 5)
    assert guard.report is not None and guard.report.status == "healthy"


def _checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    state = opt.state_dict()
    state["state"][2]["exp_avg_sq"][0, 5] = float("nan")  # param 2: the second Linear's weight
    torch.save({"model": model.state_dict(), "optimizer": state}, path)


@pytest.mark.parametrize("when", ["before", "after", "replay"])
def test_nan_loaded_from_a_checkpoint_is_named(tmp_path: Path, when: str) -> None:
    """`replay`: loaded before, with `replay=` given; a loaded value is not replayed (no op of
    the step made it) and the finding keeps phase `checkpoint`."""
    _checkpoint(tmp_path / "ckpt.pt")
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    def load() -> None:
        ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])  # LOAD LINE

    if when in ("before", "replay"):
        load()
    replay = (lambda x: model(x).pow(2).mean()) if when == "replay" else None
    guard = nanguard.Guard(model, opt, out=tmp_path / "r", replay=replay)
    if when == "after":
        load()
    _steps(model, opt, guard, 4)
    report = guard.close()
    first = report.first_nonfinite
    assert first is not None and report.status == "failed"
    assert first["step"] == 0 and first["phase"] == "checkpoint"
    assert first["tensors"] == ["optimizer.exp_avg_sq[2.weight]"]
    assert first["samples"] == [] and first["op"] is None
    if when == "after":  # seen by the guard's own load_state_dict hook
        line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1)
                    if "# LOAD LINE" in t)
        assert first["source"] == f"{__file__}:{line}"


def test_each_loaded_tensor_keeps_the_line_that_loaded_it(tmp_path: Path) -> None:
    """A NaN in the model's weights, loaded after the Guard was built by the model's
    `load_state_dict`, then the optimizer's on the next line: the finding names the weights'
    line (the model's), not the last load line (the optimizer's)."""
    _checkpoint(tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    ckpt["optimizer"]["state"][2]["exp_avg_sq"][0, 5] = 1.0  # a clean optimizer state
    ckpt["model"]["0.weight"][1, 2] = float("nan")
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nanguard.Guard(model, opt, out=tmp_path / "r")
    model.load_state_dict(ckpt["model"])  # WEIGHTS LINE
    opt.load_state_dict(ckpt["optimizer"])
    _steps(model, opt, guard, 2)
    first = guard.close().first_nonfinite
    assert first is not None and first["phase"] == "checkpoint"
    assert first["tensors"] == ["0.weight"]
    line = next(i for i, t in enumerate(Path(__file__).read_text().splitlines(), 1)
                if "# WEIGHTS LINE" in t)
    assert first["source"] == f"{__file__}:{line}"
