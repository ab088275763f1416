"""In process: the runner leaves no global hook or patch behind (also when the script fails),
hands the loss and the data batch to the right optimizer of a GAN-like loop, and the merge
orders findings by step, phase, rank and survives a rank that wrote nothing."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.nn.modules import module as module_mod
from torch.optim import optimizer as optimizer_mod

from nanguard.record.merge import collect_rank_reports, merge_reports
from nanguard.record.report import Report
from nanguard.run.runner import RunOptions, run

SCRIPT = """
import json
import sys
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(4):
    x = torch.randn(5, 3)
    if step == 2:
        x[4, 0] = float("inf")
    with torch.no_grad():
        model(torch.full((7, 3), float("nan")))  # evaluation: not the training batch
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
if sys.argv[1:] == ["--fail"]:
    raise RuntimeError("the script's own bug")
"""


def _global_hooks() -> int:
    return (len(optimizer_mod._global_optimizer_pre_hooks)
            + len(optimizer_mod._global_optimizer_post_hooks)
            + len(module_mod._global_forward_pre_hooks) + len(module_mod._global_forward_hooks))


def test_runner_in_process_leaves_nothing_behind(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    backward, argv, path0, hooks = torch.Tensor.backward, sys.argv[:], sys.path[0], _global_hooks()
    for args, code in (([], 1), (["--fail"], 1)):
        out = tmp_path / f"run{len(args)}"
        rc = run(RunOptions(script=str(script), args=args, out=str(out), replay_budget=0,
                            summary=False))
        assert rc == code
        assert torch.Tensor.backward is backward
        assert (sys.argv, sys.path[0], _global_hooks()) == (argv, path0, hooks)
        rep = Report(**json.loads((out / "report.json").read_text()))
        first = rep.first_nonfinite
        assert first is not None
        # The training batch (not the no_grad evaluation one) and the loss were captured.
        assert (first["step"], first["phase"], first["samples"]) == (2, "data", [4])
        assert "loss" in first["signals"]
    assert rep.run["script"]["outcome"] == "error"


def _rep(step: int, phase: str, rank: int) -> Report:
    first = {"step": step, "phase": phase, "rank": rank, "samples": [], "module": None,
             "op": None, "source": None}
    return Report(status="failed", steps=10, first_nonfinite=first,
                  diagnosis=[{"cause": f"{phase}-{rank}", "confidence": 0.5, "evidence": "",
                              "fix": ""}])


def test_merge_order_step_phase_rank() -> None:
    parts = [("rank-0", _rep(5, "backward", 0)), ("rank-1", _rep(5, "data", 1)),
             ("rank-2", _rep(5, "data", 2)), ("rank-3", _rep(6, "data", 3))]
    m = merge_reports(parts)
    assert (m.first_nonfinite["rank"], m.first_nonfinite["ranks"]) == (1, [1, 2])
    assert m.first_nonfinite["part"] == "rank-1" and m.diagnosis[0]["cause"] == "data-1"
    assert merge_reports([parts[3], parts[0]]).first_nonfinite["rank"] == 0  # earlier step wins
    healthy = merge_reports([("a", Report(steps=3)), ("b", Report(steps=4))])
    assert healthy.status == "healthy" and healthy.steps == 4 and healthy.first_nonfinite is None


def test_collect_does_not_wait_forever_for_a_dead_rank(tmp_path: Path) -> None:
    (tmp_path / "rank-0").mkdir()
    _rep(3, "data", 0).write(tmp_path / "rank-0")
    parts, missing = collect_rank_reports(tmp_path, 2, wait_s=0.2)
    assert [label for label, _ in parts] == ["rank-0"] and missing == [1]
