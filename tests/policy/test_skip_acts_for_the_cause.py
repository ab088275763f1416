"""`skip` acts for the cause it can answer (issue 40 items 2 and 4; `policy.recurrence`).

- A recurring instability (a small MLP whose SGD LR ramps past its stability limit: the grad
  norm climbs step after step, the script's own measurement says so) is not skipped after its
  first unexplained spike: the later spike alarms' updates go ahead, and why is recorded and
  said once (`not_skipped`). Main's rule discarded the update of every spike alarm.
- Planted bad batches (8 of 32 rows from a corrupted region at steps the script prints,
  `bad_rows_lm.py`) 8 steps apart are each skipped, their rows named in the skip's action and
  its live line: spikes traced to their batches never count as a recurring instability.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "programs"))
from programs_support import guarded  # noqa: E402

STEPS = 140
RAMP_TO = 0.3  # the SGD LR at step 100 (from 0.01): past this MLP's stability limit


def _ramp(tmp_path: Path, replay: bool = False, resume_at: int | None = None
          ) -> tuple[list[float], dict]:
    """Train the MLP under `skip` (with `replay`: the guard can replay a batch row by row;
    `resume_at`: a new guard takes over at that step from the first one's `state_dict`, as
    after a checkpoint); its own grad norm of every step, and the (last guard's) report."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def new_guard(name: str) -> nanguard.Guard:
        return nanguard.Guard(
            model, opt, policy="skip", out=tmp_path / name,
            replay=(lambda b: nn.functional.mse_loss(model(b[0]), b[1])) if replay else None,
            config=GuardConfig(record=RecordConfig(summary=False)))

    guard, out = new_guard("run"), tmp_path / "run"
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 1, generator=gen)
    norms = []
    for i in range(STEPS):
        if i == resume_at:
            state = json.loads(json.dumps(guard.state_dict()))  # as a checkpoint holds it
            guard.close()
            guard, out = new_guard("resumed"), tmp_path / "resumed"
            guard.load_state_dict(state)
        # A warm-up-like ramp (never 3x in a step: no LR jump), then back down at 112.
        lr = 0.01 + (RAMP_TO - 0.01) * min(1.0, i / 100) if i < 112 else 0.02
        for group in opt.param_groups:
            group["lr"] = lr
        x = torch.randn(32, 8, generator=gen)
        loss = nn.functional.mse_loss(model(x), x @ w)
        guard.watch(loss=loss, batch=(x, x @ w))
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])))
        opt.step()
    guard.close()
    return norms, json.loads((out / "report.json").read_text())


def test_a_recurring_instability_is_skipped_once_then_held(tmp_path: Path, caplog) -> None:
    caplog.set_level("WARNING", logger="nanguard")
    norms, report = _ramp(tmp_path)
    # The script's own evidence of an instability: after the first step at 5x the grad norm's
    # level of steps 40-90, more such steps follow within 20 steps (it is no lone bad step).
    level = statistics.median(norms[40:90])
    high = [i for i, n in enumerate(norms) if n > 5 * level]
    assert len(high) >= 5 and high[4] - high[0] <= 20, (level, high)

    spikes = sorted({a["step"] for a in report["alarms"] if a["kind"] == "spike"})
    assert len(spikes) >= 3, report["alarms"]
    skips = [a for a in report["actions"] if a["action"] == "skip"]
    held = [a for a in report["actions"] if a["action"] == "not_skipped"]
    # The first spike (lone so far) is skipped; no later one is.
    assert [a["step"] for a in skips] == [spikes[0]], report["actions"]
    assert len(held) == 1 and held[0]["step"] in spikes[1:], report["actions"]
    assert "none traced to a batch" in held[0]["detail"] and "heal" in held[0]["detail"]
    assert report["run"]["recovery"]["skips"]["count"] == 1
    said = [r.getMessage() for r in caplog.records if "not_skipped" in r.getMessage()]
    assert len(said) == 1 and f"step {held[0]['step']}" in said[0], said


def test_a_resumed_guard_remembers_the_instability(tmp_path: Path) -> None:
    """Resumed between the instability's first spike and its next, the policy judges the next
    as the uninterrupted run did (held, its update kept), not as a lone spike to discard: its
    memory of the spikes rides in the guard's `state_dict`."""
    _, whole = _ramp(tmp_path / "whole")
    acted = [(a["step"], a["action"], a["detail"]) for a in whole["actions"]]
    (first, *_), (second, kind, _) = acted[:2]
    assert kind == "not_skipped" and second - first > 1, acted
    _, resumed = _ramp(tmp_path / "split", resume_at=first + 1)
    assert [(a["step"], a["action"], a["detail"]) for a in resumed["actions"]] == acted


def test_bad_batches_close_together_are_each_skipped_with_their_rows(tmp_path: Path,
                                                                       caplog) -> None:
    caplog.set_level("WARNING", logger="nanguard")
    run = guarded(tmp_path, "bad_rows_lm.py", "--corrupt-at", "70,78", policy="skip")
    truth = {int(s): [int(r) for r in rows.split(",")] for s, rows in
             re.findall(r"BAD_BATCH step (\d+) rows ([\d,]+)", run.proc.stderr)}
    assert sorted(truth) == [70, 78]
    rep = run.report
    skips = {a["step"]: a["detail"] for a in rep["actions"] if a["action"] == "skip"}
    assert sorted(skips) == [70, 78], run.explain()
    assert not [a for a in rep["actions"] if a["action"] == "not_skipped"], rep["actions"]
    for step, rows in truth.items():
        assert f"rows {rows}" in skips[step], (step, rows, skips[step])
        assert "a bad batch (batch " in skips[step]
    live = run.proc.stderr
    for step, rows in truth.items():
        assert re.search(rf"step {step} action skip: .*rows {re.escape(str(rows))}", live), \
            live[-3000:]


def test_a_spike_its_replay_rules_the_batch_out_of_is_not_skipped(tmp_path: Path) -> None:
    """The same run with a replay: the first spike's rows, measured one by one before its
    update, have no row standing out (every row's gradient rose together), so even the first
    spike is the optimizer's: no update is discarded, the hold is said once, on that spike."""
    _, report = _ramp(tmp_path, replay=True)
    spikes = sorted({a["step"] for a in report["alarms"] if a["kind"] == "spike"})
    assert len(spikes) >= 3, report["alarms"]
    assert not [a for a in report["actions"] if a["action"] == "skip"], report["actions"]
    held = [a for a in report["actions"] if a["action"] == "not_skipped"]
    assert [a["step"] for a in held] == [spikes[0]], report["actions"]
    assert "replayed row by row" in held[0]["detail"], held[0]["detail"]
    assert report["status"] == "warned"  # nothing was done: not `recovered`
