"""Reduced-precision overflow: under `torch.autocast("cpu", dtype=torch.float16)` the second
Linear's output exceeds float16's 65504 (it is ~1e5, fine in float32): inf at `aten.addmm` in
the forward of `fc2`. Skipped where CPU autocast has no float16."""

import torch
from torch import nn

from . import Built

EXPECTED = {"phase": "forward", "module": "fc2", "op": "aten.addmm", "samples": None,
            "cause": "low_precision_overflow"}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def supported() -> str | None:
    """None when float16 autocast works on the CPU here, else why not."""
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = nn.Linear(2, 2)(torch.ones(1, 2))
    except Exception as e:  # noqa: BLE001 - any failure means: not supported here
        return f"float16 CPU autocast unavailable: {e}"
    if out.dtype != torch.float16:
        return f"CPU autocast produced {out.dtype}, not float16"
    return None


def build() -> Built:
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc1.weight.uniform_(0.5, 1.0)
        model.fc2.weight.uniform_(0.5, 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.rand(4, 8) * 100 + 400, torch.randn(4, 4)

    def step() -> torch.Tensor:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(model=model, optimizer=opt, batch=(x, y), step=step, skip=supported())
