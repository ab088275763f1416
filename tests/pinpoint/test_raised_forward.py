"""A forward that raises (the script's own NaN check, a shape error) and a value written into a
tensor through a view: the checker, the phase tracker and the end-of-run frame scan."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nanguard.pinpoint.attribution import Attribution
from nanguard.pinpoint.replay import find_origin
from nanguard.run.held import nonfinite_locals


class LogFeatures(nn.Module):
    """Log-transforms column 0 in place of a copy, then a Linear; checks its hidden state."""

    def __init__(self, check: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.check = check

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, 0] = torch.log(x[:, 0])
        h = self.lin(x - 1.0)
        if self.check and not torch.isfinite(h).all():
            raise FloatingPointError("non-finite hidden state")
        return h


def _batch(zero_row: int | None) -> torch.Tensor:
    x = torch.rand(6, 3) + 0.5
    if zero_row is not None:
        x[zero_row, 0] = 0.0
    return x


def test_a_value_written_through_a_view_keeps_its_origin() -> None:
    """`x[:, 0] = log(x[:, 0])` writes -inf into `x` through a view; the next op reads `x`
    itself. The origin is the `log` (sample 4), not an input the next op met."""
    torch.manual_seed(0)
    model = LogFeatures()
    x = _batch(4)
    origin = find_origin(lambda: model(x).sum().backward(), model=model, batch=x)
    assert origin is not None
    assert (origin.phase, origin.op, origin.kind, origin.samples) == (
        "forward", "aten.log", "op", [4])


def test_finite_data_through_a_view_finds_nothing() -> None:
    torch.manual_seed(0)
    model = LogFeatures()
    x = _batch(None)
    assert find_origin(lambda: model(x).sum().backward(), model=model, batch=x) is None


def test_a_raised_forward_leaves_the_phase_tracker_balanced() -> None:
    """After a forward raised, the ops that follow are not taken for that module's forward."""
    model = LogFeatures(check=True)
    attr = Attribution(model=model).install()
    try:
        with pytest.raises(FloatingPointError):
            model(_batch(1))
        assert (attr.module(), attr.phase()) == (None, "loss")
    finally:
        attr.remove()


def test_the_frames_of_a_raised_forward_name_what_it_held() -> None:
    outer = nn.Sequential(LogFeatures(check=True))
    with pytest.raises(FloatingPointError) as info:
        outer(_batch(2))
    found = nonfinite_locals(info.tb, [outer])
    assert found is not None
    assert (found["phase"], found["module"]) == ("forward", "0")
    assert found["signals"][0].startswith("h, x in LogFeatures.forward (")


def test_a_shape_error_with_finite_values_holds_nothing() -> None:
    model = LogFeatures(check=True)
    with pytest.raises(RuntimeError) as info:
        model(torch.rand(6, 5) + 0.5)
    assert nonfinite_locals(info.tb, [model]) is None
