"""On a GPU under `observe`, a step makes no blocking host read: `optimizer.step()` never waits.

The step's packet is copied to pinned host memory with `non_blocking=True` and read one step
later; CUDA's sync debug mode in "error" turns any synchronizing call nanguard would make on the
hot path (a `.item()`, a blocking copy, a `nonzero`) into an exception. Skipped without CUDA (this
project's CI machine has none); run it where a GPU is lent:
`python -m pytest -q tests/perf/test_gpu_no_sync.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256),
                          nn.Linear(256, 10)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.parametrize("activations", [False, True])
def test_observe_makes_no_blocking_read(tmp_path: Path, activations: bool) -> None:
    model, opt = _model()
    guard = Guard(model, opt, out=tmp_path / str(activations), activations=activations,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    batches = [(torch.randn(32, 64, device="cuda"), torch.randint(0, 10, (32,), device="cuda"))
               for _ in range(12)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        guard.watch(loss=loss, batch=(x, y))
        opt.step()
        opt.zero_grad()

    for x, y in batches[:2]:  # the first step checks loaded state and allocates: not timed
        step(x, y)
    torch.cuda.synchronize()
    reads = guard.host_reads
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[2:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.host_reads - reads <= len(batches) - 2  # at most one read per step
    report = guard.close()
    assert report.status == "healthy" and report.steps == len(batches)


def test_observe_on_gpu_still_finds_the_nan(tmp_path: Path) -> None:
    """Read a step late, a NaN is still reported at the step it appeared."""
    model, opt = _model()
    guard = Guard(model, opt, out=tmp_path / "nan",
                  config=GuardConfig(record=RecordConfig(summary=False)))
    for k in range(6):
        x = torch.randn(32, 64, device="cuda")
        if k == 4:
            x[3, 0] = float("nan")
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,), device="cuda"))
        loss.backward()
        guard.watch(loss=loss, batch=x)
        opt.step()
        opt.zero_grad()
    report = guard.close()
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["step"] == 4 and 3 in report.first_nonfinite["samples"]
