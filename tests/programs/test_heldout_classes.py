"""The classes the held-out programs of issue 37 showed (BENCHMARKS.md, "Held-out programs"), on
look-alike programs run black box through `nanguard run` (the command's `main`, in the test's
process; the fault through a flag): a softmax regression with a hand-written SGD step and an LR
typed 300x too large, a character MLP with a batch norm written by hand run with `--batch-size
1`, and a REINFORCE whose `--gamma 99` (for 0.99) sums returns past float32. The fix names the
flag.

The expected finding is established without nanguard: each script prints `NOTE ... at update
K` from its own check (logits past `exp`'s float32 range, a batch of one row, returns beyond
float32 in float64), and the op's line is found in the script's own text. A healthy run of
the on-policy REINFORCE, at its default flags under the default policy, is not warned.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from unittest import mock

from programs_support import finding_of, guarded, noted, script_where

import in_process

SOFTMAX = "scratch_softmax.py"


def test_hand_written_sgd_lr_typo_is_fixed_in_the_lr_flag(tmp_path: Path) -> None:
    """`--lr 30`: no optimizer reports an LR, the flag named for one set it (was: "your LR /
    100")."""
    g = guarded(tmp_path, SOFTMAX, "--lr", "30", "--epochs", "1", policy="raise")
    want = {"status": "failed", "step": noted(g, "logits beyond exp's range"),
            "op": "aten.exp", "source": script_where(SOFTMAX, "torch.exp(z)"),
            "cause": "optimizer_divergence"}
    assert finding_of(g) == want, g.explain()
    fix = g.report["diagnosis"][0]["fix"]
    proposed = re.search(r"`--lr 30` -> `--lr ([0-9.e-]+)`", fix)
    assert proposed is not None and 0 < float(proposed.group(1)) < 30, fix
    # `nanguard replay` of a run the raise policy stopped in its failing step (that step never
    # completed: it was refused as "outside the run's 1 steps") names the same line and fix.
    # The command's `main` in this process (it re-runs the script here too): its output.
    with mock.patch.dict(os.environ, {"COLUMNS": "2000"}):
        r = in_process.nanguard(["replay", str(g.out)], tmp_path)
    assert r.returncode == 1 and "matches the recorded finding" in r.stdout, r.stdout + r.stderr
    assert f"/{want['source']}\n" in r.stdout and fix in r.stdout, r.stdout


BN = "char_bn_mlp.py"


def test_batch_norm_by_hand_over_a_batch_size_of_one(tmp_path: Path) -> None:
    g = guarded(tmp_path, BN, "--batch-size", "1", "--steps", "3", policy="raise")
    want = {"status": "failed", "step": noted(g, "batch of 1"), "op": "aten.std",
            "source": script_where(BN, "std_i = hpre.std(0"), "cause": "division_by_zero"}
    assert finding_of(g) == want, g.explain()
    assert g.report["diagnosis"][0]["fix"].startswith(
        "`--batch-size 1` makes batches of 1 row: set `--batch-size 2` or more")


WALK = "reinforce_walk.py"


def test_reinforce_discount_typo_is_read_back_to_its_flag(tmp_path: Path) -> None:
    g = guarded(tmp_path, WALK, "--gamma", "99", "--episodes", "10", policy="raise")
    want = {"status": "failed", "step": noted(g, "returns beyond float32"),
            "op": "aten.lift_fresh",
            "source": script_where(WALK, "returns_t = torch.tensor(returns)"),
            "cause": "cast_overflow"}
    assert finding_of(g) == want, g.explain()
    assert "did you mean `--gamma 0.99`?" in g.report["diagnosis"][0]["fix"]


def test_healthy_reinforce_is_not_warned(tmp_path: Path) -> None:
    """On-policy: a new episode each update, no alarm of any kind at the default flags."""
    g = guarded(tmp_path, WALK, "--episodes", "25")
    assert g.proc.returncode == 0, g.explain()
    assert g.report["status"] == "healthy" and not g.report.get("alarms"), g.explain()
