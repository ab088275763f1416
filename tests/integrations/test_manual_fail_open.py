"""The hand-written-update boundaries of `nanguard run` fail open: an error of nanguard's own
while they find, name or wrap the trained tensors never reaches the script."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from nanguard.run import manual
from nanguard.run.runner import RunOptions, run

RAW = """
import sys
import torch
torch.manual_seed(0)
X = torch.randn(64, 3)
Y = X @ torch.tensor([[1.0], [-2.0], [0.5]])
W = torch.zeros(3, 1, requires_grad=True)
b = torch.zeros(1, requires_grad=True)
for step in range(30):
    loss = ((X @ W + b - Y) ** 2).mean()
    W.grad = b.grad = None
    loss.backward()
    with torch.no_grad():
        W -= 0.05 * W.grad
        b -= 0.05 * b.grad
torch.save({"W": W.detach(), "b": b.detach()}, sys.argv[1])
"""


@pytest.mark.parametrize("where", ["leaves_of", "_script_names"])
def test_an_error_in_the_manual_boundaries_never_stops_the_script(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """nanguard's own bug in finding the raw tensors a loss trains (`leaves_of`) or in naming
    them (`_script_names`) at the first `backward()`: the script runs to its end with its
    parameters bitwise those of a run alone, and the run reads `degraded` (exit 1) with the
    error, not `unwatched` and not a crash."""
    script = tmp_path / "train.py"
    script.write_text(RAW)
    alone, watched = tmp_path / "alone.pt", tmp_path / "watched.pt"
    argv = sys.argv
    sys.argv = [str(script), str(alone)]
    try:
        exec(compile(RAW, str(script), "exec"), {"__name__": "__main__"})  # noqa: S102
    finally:
        sys.argv = argv

    def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError("bug inside the boundaries")

    monkeypatch.setattr(manual, where, broken)
    out = tmp_path / "run"
    rc = run(RunOptions(script=str(script), args=[str(watched)], out=str(out), summary=False))
    report = json.loads((out / "report.json").read_text())
    assert (rc, report["status"], report["run"]["script"]["outcome"]) == (1, "degraded", "ok")
    assert "bug inside the boundaries" in report["run"]["internal_error"]["error"]
    a, w = torch.load(alone), torch.load(watched)
    assert all(torch.equal(a[k], w[k]) for k in ("W", "b"))
