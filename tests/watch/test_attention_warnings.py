"""A warning the user's own code raises inside an armed forward is shown at the user's line,
once: not a second time from nanguard's attention probe (its TorchFunctionMode sits between
the user's call and torch's `warnings.warn(..., stacklevel=2)`)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from nanguard.watch.attention import AttentionProbe


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout2d(self.lin(x), 0.1, training=True)  # 2-d input: torch warns


def test_the_users_warning_points_at_the_users_line():
    net = _Net()
    probe = AttentionProbe(net)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        probe.enabled = True
        net(torch.randn(4, 8))
        probe.enabled = False
        net(torch.randn(4, 8))
    assert probe.armed_forwards == 1
    assert [w.filename for w in seen] == [__file__, __file__]
    assert len({w.lineno for w in seen}) == 1


def test_shown_once_under_the_default_filter():
    net = _Net()
    probe = AttentionProbe(net)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        before = warnings.showwarning
        net(torch.randn(4, 8))  # unarmed: the user's line enters its module's registry
        probe.enabled = True
        net(torch.randn(4, 8))  # armed: the same warning, the same line: not shown again
        probe.enabled = False
        assert warnings.showwarning is before  # the armed forward's hook is gone with it
    assert [w.filename for w in seen] == [__file__]
