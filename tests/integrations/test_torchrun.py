"""`torchrun -m nanguard run` with 2 gloo processes on CPU, rank 1 alone fed a NaN batch: both
ranks take the same action in the same step (`raise` stops both, `skip` skips on both and
training finishes), the merged report names rank 1, nothing hangs; FSDP2 (fully_shard) runs
too and its gradient norms of sharded (DTensor) parameters equal DDP's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from _run import EXAMPLES, report, torchrun

from nanguard.record.store import dec, open_run

DDP = EXAMPLES / "ddp_torchrun.py"
POISON = ("--steps", "16", "--poison-step", "6", "--poison-rank", "1", "--poison-sample", "3")


def _check_merged(out: Path) -> dict:
    rep = report(out)
    first = rep["first_nonfinite"]
    assert (first["step"], first["phase"], first["rank"], first["samples"]) == (6, "data", 1, [3])
    assert first["ranks"] == [1]
    # Rank 0 saw it only in its all-reduced gradients; rank 1 in its batch.
    assert report(out / "rank-0")["first_nonfinite"]["phase"] == "backward"
    assert report(out / "rank-1")["first_nonfinite"]["phase"] == "data"
    return rep


def test_raise_stops_every_rank_in_the_same_step(tmp_path: Path) -> None:
    out = tmp_path / "raise"
    started = time.monotonic()
    r = torchrun(out, 2, ("--policy", "raise"), DDP, *POISON)
    assert time.monotonic() - started < 90
    assert r.returncode != 0
    rep = _check_merged(out)
    for rank in (0, 1):
        actions = report(out / f"rank-{rank}")["actions"]
        assert [(a["step"], a["action"]) for a in actions] == [(6, "raise")], rank
        assert "non-finite first on rank 1" in actions[0]["detail"]
        assert report(out / f"rank-{rank}")["steps"] == 6
    assert rep["status"] == "failed"
    assert "done:" not in r.stdout


def _grad_norms(folder: Path) -> list[float]:
    db = open_run(folder)
    try:
        return [dec(g) for (g,) in db.execute("SELECT grad_norm FROM steps ORDER BY step")]
    finally:
        db.close()


def _skip_run(out: Path, fsdp: bool) -> Path:
    started = time.monotonic()
    r = torchrun(out, 2, ("--policy", "skip"), DDP, *POISON, *(["--fsdp"] if fsdp else []))
    assert time.monotonic() - started < 90
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: 16 steps on 2 ranks" in r.stdout
    # Live lines while it trains, each rank saying what it saw.
    assert "nanguard: rank 1: step 6 nonfinite" in r.stderr, r.stderr[-3000:]
    assert "nanguard: rank 0: step 6 action skip" in r.stderr
    rep = _check_merged(out)
    assert rep["status"] == "recovered"
    for rank in (0, 1):
        part = report(out / f"rank-{rank}")
        assert [(a["step"], a["action"]) for a in part["actions"]] == [(6, "skip")], rank
        assert part["steps"] == 16
    norms = _grad_norms(out / "rank-0")
    assert len(norms) == 16 and all(n > 0 for i, n in enumerate(norms) if i != 6)
    return out


@pytest.fixture(scope="module")
def ddp_skip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _skip_run(tmp_path_factory.mktemp("ddp") / "skip", fsdp=False)


def test_skip_on_every_rank_and_training_finishes(ddp_skip: Path) -> None:
    assert (ddp_skip / "rank-1" / "run.db").is_file()


def test_fsdp2_skip_and_sharded_grad_norms(tmp_path: Path, ddp_skip: Path) -> None:
    out = _skip_run(tmp_path / "skip", fsdp=True)
    # Sharded (DTensor) parameters: local shard norms plus one all-reduce give the norm of the
    # whole gradient, the same as DDP's (same model, data and skipped step).
    norms, ddp = _grad_norms(out / "rank-0"), _grad_norms(ddp_skip / "rank-0")
    for i, (a, b) in enumerate(zip(norms, ddp, strict=True)):
        if i != 6:
            assert a == pytest.approx(b, rel=1e-4), i
