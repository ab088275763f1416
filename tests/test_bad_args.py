"""Arguments that cannot work raise ValueError at once, with a one-line message that says what
to do: an unknown policy, a model that is not an `nn.Module`, an optimizer that is not an
`Optimizer`, impossible watch settings, and a run folder that cannot be written. A refused guard
leaves nothing behind on the model or the optimizer (no hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, WatchConfig

# Words that tell the user what to do next.
ADVICE = ("use ", "pass ", "must be ", "one of")


def _model_and_optimizer():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _assert_actionable(exc: pytest.ExceptionInfo[ValueError], *mentions: str) -> None:
    msg = str(exc.value)
    assert msg and "\n" not in msg, f"not one line: {msg!r}"
    assert any(word in msg for word in ADVICE), f"does not say what to do: {msg!r}"
    for m in mentions:
        assert m in msg, f"{m!r} missing from {msg!r}"


def _assert_no_hooks(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    assert not optimizer._optimizer_step_pre_hooks
    assert not optimizer._optimizer_step_post_hooks
    for name, module in model.named_modules():
        assert not module._forward_hooks, f"hook left on {name!r}"


def test_unknown_policy():
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(model, opt, policy="ignore", out="")
    _assert_actionable(exc, "'ignore'", "observe")
    with pytest.raises(ValueError) as exc:
        Guard(model, opt, out="", config=GuardConfig(policy="nope"))
    _assert_actionable(exc, "'nope'")
    _assert_no_hooks(model, opt)


def test_model_not_a_module():
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(model.state_dict(), opt, out="")  # type: ignore[arg-type]
    _assert_actionable(exc, "nn.Module", "OrderedDict")
    with pytest.raises(ValueError) as exc:
        Guard(lambda x: x, opt, out="")  # type: ignore[arg-type]
    _assert_actionable(exc, "nn.Module")


def test_optimizer_not_an_optimizer():
    model, _ = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(model, list(model.parameters()), out="")  # type: ignore[arg-type]
    _assert_actionable(exc, "Optimizer", "list")
    scheduler_like = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), 0.1), 1)
    with pytest.raises(ValueError) as exc:
        Guard(model, scheduler_like, out="")  # type: ignore[arg-type]
    _assert_actionable(exc, "StepLR")


@pytest.mark.parametrize(
    "watch",
    [
        WatchConfig(read_every=0),
        WatchConfig(activations_every=0),
        WatchConfig(update_ratio_every=-1),
    ],
)
def test_impossible_watch_settings(watch):
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(model, opt, out="", config=GuardConfig(watch=watch))
    _assert_actionable(exc)


def test_buffered_reads_with_an_acting_policy():
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(
            model, opt, policy="skip", out="", config=GuardConfig(watch=WatchConfig(read_every=4))
        )
    _assert_actionable(exc, "read_every")


@pytest.mark.parametrize("activations", [False, True])
def test_unwritable_run_folder(tmp_path, activations):
    """Tests run as root (chmod does not stop root): a path under a regular file cannot be made."""
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    model, opt = _model_and_optimizer()
    with pytest.raises(ValueError) as exc:
        Guard(model, opt, out=blocker / "run", activations=activations)
    _assert_actionable(exc, str(blocker / "run"), "out=")
    _assert_no_hooks(model, opt)
    # The same run folder given as the file itself.
    with pytest.raises(ValueError) as exc:
        Guard(model, opt, out=blocker, activations=activations)
    _assert_actionable(exc, "out=")
    _assert_no_hooks(model, opt)
