"""A monitor never breaks training, and a status never lies.

Covers: an error inside nanguard's own hooks (stands down, traceback in the run folder, status
`degraded`, training bitwise as without nanguard); float64 models (they crashed inside
`optimizer.step()`); the statuses `unwatched`, `crashed`, `interrupted` and `died`; a NaN
before the first optimizer step; `nanguard report` exit codes for each.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nanguard
from nanguard.cli.main import main
from nanguard.record.report import OK_STATUSES, STATUSES, load_report
from nanguard.watch.lane import QuietLane
from nanguard.watch.step import StepWatch


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1)).to(dtype)


def _train(model: nn.Module, opt: torch.optim.Optimizer, guard: nanguard.Guard | None,
           steps: int, dtype: torch.dtype = torch.float32) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=g, dtype=dtype)
        y = x.sum(1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_internal_error_stands_down_and_training_is_untouched(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = _mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _train(ref, opt, None, 6)

    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = nanguard.Guard(model, opt, out=tmp_path / "run", policy="skip")
    calls = {"n": 0}

    # The post-update pass: made on every step, in the quiet lane or the packet path.
    def failing(original: Any) -> Any:
        def broken(*args: object, **kwargs: object) -> object:
            calls["n"] += 1
            if calls["n"] == 3:  # the third step: nanguard's own bug
                raise RuntimeError("bug inside nanguard")
            return original(*args, **kwargs)
        return broken

    monkeypatch.setattr(QuietLane, "read", failing(QuietLane.read))
    monkeypatch.setattr(StepWatch, "end", failing(StepWatch.end))
    _train(model, opt, guard, 6)
    report = guard.close()

    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)  # training went on exactly as without nanguard
    assert report.status == "degraded"
    assert report.run["internal_error"]["error"] == "RuntimeError: bug inside nanguard"
    assert report.run["internal_error"]["step"] == 2
    text = (tmp_path / "run" / "nanguard_error.txt").read_text()
    assert "bug inside nanguard" in text and "Traceback" in text
    assert calls["n"] == 3  # stood down: no hook ran after the error
    assert json.loads((tmp_path / "run" / "report.json").read_text())["status"] == "degraded"


def test_float64_model_is_watched(tmp_path: Path) -> None:
    model = _mlp(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with nanguard.Guard(model, opt, out=tmp_path / "run") as guard:
        _train(model, opt, guard, 5, torch.float64)
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")
        _train(model, opt, guard, 1, torch.float64)
    report = guard.report
    assert report is not None
    assert guard.error is None
    assert report.steps == 6
    assert report.status == "failed"
    assert report.first_nonfinite is not None and report.first_nonfinite["step"] == 5


def test_float64_norm_beyond_float32_is_not_nonfinite(tmp_path: Path) -> None:
    """A float64 parameter of 1e100 is finite: its norm (beyond float32) must not read as inf."""
    model = nn.Linear(2, 1).double()
    with torch.no_grad():
        model.weight.fill_(1e100)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.Guard(model, opt, out="") as guard:
        for _ in range(3):
            loss = model(torch.zeros(4, 2, dtype=torch.float64)).sum()
            guard.watch(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.report is not None and guard.report.status == "healthy"


def test_no_step_is_unwatched(tmp_path: Path) -> None:
    model = _mlp()
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), out=tmp_path / "r")
    assert guard.close().status == "unwatched"


def test_nan_before_the_first_step_fails(tmp_path: Path) -> None:
    """The script dies in its first iteration (BCE's range check, say) after the loss went NaN:
    no optimizer step ever ran, and the run is `failed`, not `healthy`."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError), nanguard.Guard(model, opt, out=tmp_path / "r") as guard:
        x = torch.randn(8, 4)
        x[5, 2] = float("nan")
        guard.watch(loss=model(x).mean(), batch=x)
        raise RuntimeError("all elements of input should be between 0 and 1")
    report = guard.report
    assert report is not None and report.status == "failed"
    assert report.first_nonfinite is not None
    assert report.first_nonfinite["samples"] == [5] and report.first_nonfinite["phase"] == "data"
    assert report.run["ended"]["how"] == "error"


@pytest.mark.parametrize(("exc", "status"), [(ValueError("boom"), "crashed"),
                                             (KeyboardInterrupt(), "interrupted")])
def test_with_block_ending_by_an_exception(tmp_path: Path, exc: BaseException,
                                           status: str) -> None:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(type(exc)), nanguard.Guard(model, opt, out=tmp_path / "r") as guard:
        _train(model, opt, guard, 3)
        raise exc
    assert guard.report is not None and guard.report.status == status
    assert guard.report.status not in OK_STATUSES


_SCRIPT = """
import time, sys, torch
from torch import nn
import nanguard
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
guard = nanguard.Guard(model, opt, out=sys.argv[1])   # plain object, never closed by hand
for step in range(10**9):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    guard.watch(loss=loss)
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 3:
        print("ready", flush=True)
        if sys.argv[2] == "raise":
            raise ValueError("the script's own bug")
        if sys.argv[2] == "exit":
            sys.exit(0)
    if step > 3:
        time.sleep(0.01)
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    out = tmp_path / f"run-{mode}"
    src = str(Path(__file__).resolve().parents[2] / "src")  # nanguard need not be installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, str(script), str(out), mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc, out


@pytest.mark.parametrize(("mode", "status"), [("raise", "crashed"), ("exit", "healthy"),
                                              ("sigterm", "interrupted")])
def test_every_ordinary_ending_writes_an_honest_report(tmp_path: Path, mode: str,
                                                       status: str) -> None:
    proc, out = _start(tmp_path, mode)
    if mode == "sigterm":
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == status, report
    assert report["steps"] >= 4
    code = main(["report", str(out)])  # `nanguard report`, in this process
    assert code == (0 if status in OK_STATUSES else 1)


def _committed(out: Path) -> int:
    """Steps the run's store holds (0 before it exists)."""
    from nanguard.record.schema import open_run

    try:
        db = open_run(out)
    except ValueError:
        return 0
    try:
        return int(db.execute("SELECT COUNT(*) FROM steps").fetchone()[0])
    except Exception:  # noqa: BLE001 - the schema not written yet
        return 0
    finally:
        db.close()


def test_sigkill_leaves_a_died_run(tmp_path: Path) -> None:
    import time

    from nanguard.record.store import RunStore

    proc, out = _start(tmp_path, "sigkill")
    time.sleep(2 * RunStore.FLUSH_SECONDS)  # it trains on; steps are committed in batches
    deadline = time.monotonic() + 30  # (a loaded machine may commit later than that)
    while _committed(out) < 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (out / "report.json").exists()
    report = load_report(out)
    assert report.status == "died" and report.steps >= 4
    code = main(["report", str(out)])  # `nanguard report`, in this process
    assert code == 1


def test_every_status_is_documented() -> None:
    page = (Path(__file__).parents[2] / "docs" / "concepts" / "statuses.md").read_text()
    for status in STATUSES:
        assert f"`{status}`" in page, status
