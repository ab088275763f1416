"""A watched model can be deep-copied and pickled whole, as training scripts do.

`copy.deepcopy(model)` makes EMA, target and best-so-far networks (and
`torch.optim.swa_utils.AveragedModel` calls it); `torch.save(model, path)` is
how pytorch/examples' word_language_model keeps its best model (and reloads it with
`torch.load` under `weights_only` and an allowlist of its classes). A hook nanguard puts on the
model lives in the model's `__dict__`: the copy took the guard with it, and the run store's
SQLite connection made both calls raise in the user's script. Here they work, the copy is
the model (same outputs) without the guard, and the guard goes on watching the original.
"""

from __future__ import annotations

import copy
import io
import textwrap
from pathlib import Path

import torch
from _run import nanguard_here, report
from torch import nn

from nanguard import Guard, GuardConfig, WatchConfig

ALLOWED = [nn.Sequential, nn.Linear, nn.ReLU, nn.LayerNorm]


def _watched(tmp_path: Path, policy: str) -> tuple[nn.Module, torch.optim.Optimizer, Guard]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # Activations on: forward hooks on every leaf module, besides the load hook.
    guard = Guard(model, opt, out=tmp_path / "run", policy=policy,
                  config=GuardConfig(watch=WatchConfig(activations=True)))
    return model, opt, guard


def _train(model: nn.Module, opt: torch.optim.Optimizer, guard: Guard | None, steps: int,
           seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_deepcopy_and_whole_model_pickle_of_a_watched_model(tmp_path: Path) -> None:
    model, opt, guard = _watched(tmp_path, "heal")
    _train(model, opt, guard, 5)
    assert any(len(m._forward_hooks) for m in model.modules())  # the guard's hooks are on it

    ema = copy.deepcopy(model)  # raised TypeError (sqlite3.Connection) before
    swa = torch.optim.swa_utils.AveragedModel(model)  # deep-copies the model inside
    buf = io.BytesIO()
    torch.save(model, buf)  # raised the same
    buf.seek(0)
    with torch.serialization.safe_globals(ALLOWED):
        loaded = torch.load(buf, weights_only=True)  # as word_language_model reloads its best

    x = torch.randn(4, 6)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(ema(x), want) and torch.equal(loaded(x), want)
        assert torch.equal(swa(x), want)
    # Copies are models of their own: trained and reloaded without touching the guard.
    steps = guard.step
    ema_opt = torch.optim.SGD(ema.parameters(), lr=1e-2)
    _train(ema, ema_opt, None, 3)
    loaded.load_state_dict(model.state_dict())  # its load hook does nothing, returns None
    assert guard.step == steps
    # The guard goes on with the original, hooks and all.
    _train(model, opt, guard, 3, seed=2)
    assert guard.step == steps + 3
    assert guard.close().status == "healthy"


SCRIPT = textwrap.dedent("""
    import copy, sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    ema = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    best = float("inf")
    for epoch in range(3):
        for step in range(10):
            x = torch.randn(16, 6)
            loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            loss.backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.mul_(0.9).add_(p, alpha=0.1)
        if loss.item() < best:
            best = loss.item()
            torch.save(model, sys.argv[1])
            torch.save(copy.deepcopy(ema), sys.argv[1] + ".ema")
    with torch.serialization.safe_globals([nn.Sequential, nn.Linear, nn.ReLU]):
        model = torch.load(sys.argv[1])
    print("reloaded", type(model).__name__)
""")


def test_nanguard_run_leaves_a_script_that_saves_whole_models_working(tmp_path: Path) -> None:
    script = tmp_path / "whole.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    r = nanguard_here(out, script, str(tmp_path / "best.pt"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reloaded Sequential" in r.stdout
    assert report(out)["status"] == "healthy"
