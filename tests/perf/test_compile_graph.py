"""A torch.compile'd model keeps its graph under a guard: no graph break, no recompile.

The guard's activation hooks run inside the compiled region (dynamo traces module hooks). A hook
that reads or writes Python state dynamo guards on (a dict of dtypes filled on the first call)
recompiles the model on the next step; a `.item()` or a data-dependent branch breaks the graph.
Compared with the same training without nanguard, counted by dynamo's own counters. The
`eager` backend: graph capture is what is tested, not code generation.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from nanguard import Guard, GuardConfig, RecordConfig


def _train(tmp_path: Path, mode: str) -> tuple[dict[str, int], dict[str, int], str | None]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = GuardConfig(record=RecordConfig(summary=False))
    guard = None
    if mode == "guard_first":  # the guard hooks the eager modules, then the model is compiled
        guard = Guard(model, opt, out=tmp_path / "a", activations=True, config=config)
    compiled = torch.compile(model, backend="eager")
    if mode == "compile_first":
        guard = Guard(compiled, opt, out=tmp_path / "b", activations=True, config=config)
    counters.clear()
    for _ in range(5):
        loss = compiled(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        if guard is not None:
            guard.watch(loss=loss)
        opt.step()
        opt.zero_grad()
    status = guard.close().status if guard is not None else None
    return dict(counters["graph_break"]), dict(counters["stats"]), status


@pytest.mark.parametrize("mode", ["guard_first", "compile_first"])
def test_compiled_model_keeps_one_graph(tmp_path: Path, mode: str) -> None:
    _, plain_stats, _ = _train(tmp_path, "plain")
    breaks, stats, status = _train(tmp_path, mode)
    assert breaks == {}
    assert stats["unique_graphs"] == plain_stats["unique_graphs"] == 1
    assert status == "healthy"


def test_compiled_activations_are_measured(tmp_path: Path) -> None:
    """The hooks really ran inside the compiled region: activation abs-max is recorded."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = Guard(model, opt, out=tmp_path / "c", activations=True,
                  config=GuardConfig(record=RecordConfig(summary=False)))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    with torch.no_grad():  # before the update changes the weights
        expected = float(model[0](x).abs().max())
    loss = compiled(x).pow(2).mean()
    loss.backward()
    guard.watch(loss=loss)
    opt.step()
    stats = guard.history[-1] if guard.history else None
    guard.close()
    assert stats is not None
    assert stats.activations["0"] == pytest.approx(expected, rel=1e-6)
    assert guard.act_probe is not None and guard.act_probe.dtypes["0"] == torch.float32
