"""Re-execution verdicts (`nanguard.pinpoint.rerun`): a spike seen before its update is re-run
from the same parameters, RNG states and batch and called `reproducible` when the loss and
every gradient come out bit for bit the same, `transient` when they do not.

The cascade (seed 0, outlier planted at step 10) spikes at step 10 and is deterministic on the
CPU: reproducible, and training bitwise as without the re-run. The same model with a layer that
keeps state outside the RNG (a call counter scaling its output, standing in for a
non-deterministic kernel or a fault) gives another result on the re-run: transient, with the
evidence that points there. A non-finite finding gets its verdict from the replay's
`reproduced`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.scenarios.cascade import make_cascade


class Drifting(nn.Module):
    """Scales its input by a factor that changes with every call (state no RNG restores)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * (1.0 + 1e-3 * self.calls)


def _train(tmp_path: Path, drift: bool, steps: int = 14) -> tuple[dict, list[torch.Tensor]]:
    s = make_cascade(0, steps=steps, outlier_at=10)
    model = nn.Sequential(Drifting(), s.model) if drift else s.model

    def replay(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return s.loss_fn(model(batch[0]), batch[1])

    cfg = GuardConfig(record=RecordConfig(out=str(tmp_path / "run"), summary=False))
    guard = Guard(model, s.optimizer, config=cfg, replay=replay)
    for x, y in s.batches:
        loss = s.loss_fn(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        s.optimizer.zero_grad()
        loss.backward()
        s.optimizer.step()
    guard.close()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    return report, [p.detach().clone() for p in s.model.parameters()]


def test_a_deterministic_spike_is_reproducible_and_changes_nothing(tmp_path: Path) -> None:
    report, params = _train(tmp_path / "a", drift=False)
    (spike,) = [s for s in report["spikes"] if s["step"] == 10]
    assert spike["rerun"]["verdict"] == "reproducible"
    assert spike["rerun"]["loss_same"] and spike["rerun"]["grads_same"]
    assert any("re-run: reproducible" in a["message"] for a in report["alarms"]
               if a["step"] == 10 and a["kind"] == "spike")
    # The re-run left training as it was: the same parameters as a run without any guard.
    s = make_cascade(0, steps=14, outlier_at=10)
    for x, y in s.batches:
        loss = s.loss_fn(s.model(x), y)
        s.optimizer.zero_grad()
        loss.backward()
        s.optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(params, s.model.parameters(), strict=True))


def test_state_outside_the_rng_makes_the_spike_transient(tmp_path: Path) -> None:
    report, _ = _train(tmp_path / "b", drift=True)
    reruns = [s["rerun"] for s in report["spikes"] if "rerun" in s]
    assert reruns, report["spikes"]
    first = reruns[0]
    assert first["verdict"] == "transient" and not first["loss_same"]
    assert first["device"] == "cpu" and "suspect the hardware" in first["why"]


def test_a_nonfinite_finding_carries_its_verdict(tmp_path: Path) -> None:
    report, _ = _train(tmp_path / "c", drift=False, steps=20)
    first = report["first_nonfinite"]
    assert first["step"] == 15 and first["reproduced"] is True
    assert first["verdict"] == "reproducible"


def _clipped_step(norm_type: float) -> tuple[nn.Module, list[torch.Tensor], tuple, float, float]:
    """One real step of a tiny MLP whose gradients the script clipped to 0.01 (far below their
    norm): its model, parameters, batch, loss and the total its `clip_grad_norm_` returned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    batch = (torch.randn(32, 6), torch.randn(32, 1))
    loss = nn.functional.mse_loss(model(batch[0]), batch[1])
    loss.backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type)
    return model, list(model.parameters()), batch, loss.item(), float(total)


def test_a_step_the_script_clipped_is_compared_through_its_clip() -> None:
    """Its `.grad` are the backward's times the clip's coefficient: compared with the re-run's
    as they are, every gradient differed and a deterministic CPU step was called `transient`
    (the tiny GPT at `--lr 1e3`: 'nondeterministic 90%'). A real difference still shows."""
    from nanguard.pinpoint.rerun import rerun_verdict

    for norm_type in (2.0, float("inf"), 1.0):
        model, params, batch, loss, total = _clipped_step(norm_type)
        assert total > 0.1  # the clip changed the gradients

        def replay(b: tuple, model: nn.Module = model) -> torch.Tensor:
            return nn.functional.mse_loss(model(b[0]), b[1])

        got = rerun_verdict(replay, model=model, params=params, batch=batch, step_rng=None,
                            loss=loss, clip_norm=total)
        assert got["verdict"] == "reproducible" and got["differing"] == 0, got
        # an L2 or max-norm clip is matched bit for bit through its total; another up to scale
        assert ("bit for bit: software" in got["why"]) == (norm_type != 1.0), got["why"]
        unclipped = rerun_verdict(replay, model=model, params=params, batch=batch,
                                  step_rng=None, loss=loss)
        assert unclipped["verdict"] == "transient"  # what the comparison without the clip said
        params[0].grad[0, 0] += 1e-3  # one gradient the re-run does not give
        got = rerun_verdict(replay, model=model, params=params, batch=batch, step_rng=None,
                            loss=loss, clip_norm=total)
        assert got["verdict"] == "transient" and got["differing"] >= 1, got
