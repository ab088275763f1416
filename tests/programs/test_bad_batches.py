"""Bad batches are named and answered for what they are (issue 40 items 1-2).

`bad_rows_lm.py` reads its batches through a DataLoader; `--corrupt-at` makes the loader fill
8 of the 32 rows of those steps' batches from a corrupted region (random bytes). The script
prints `BAD_BATCH step S rows R` for each: the truth, established without nanguard. Under
`nanguard run` (its replay names rows from per-sample gradients):

- `skip`: each bad step and no other raises spike alarms with `cause: bad_batch`, has its update
  discarded with the batch named in the action, and a `spikes` entry with the batch's
  fingerprint and exactly the corrupted rows; the status is `recovered`, not `healthy`; the
  diagnosis names the bad batches, not the optimizer.
- `heal`: each bad step is clipped as a bad batch; no LR or weight-decay cut.
- the clean run (no flag): no alarm, no action, `healthy`.
- a batch with 16 of 32 rows corrupted: every corrupted row is named and no clean one (the
  rows are judged against the loss's level before the spike, not the batch's own median).
"""

from __future__ import annotations

import re
from pathlib import Path

from programs_support import Guarded, guarded

SCRIPT = "bad_rows_lm.py"
BAD = "70,110,140"


def _truth(run: Guarded) -> dict[int, list[int]]:
    """The script's own prints: bad step -> its corrupted rows."""
    found = re.findall(r"BAD_BATCH step (\d+) rows ([\d,]+)", run.proc.stderr)
    return {int(s): [int(r) for r in rows.split(",")] for s, rows in found}


def _runs(tmp_path: Path) -> tuple[Guarded, Guarded, Guarded]:
    dirs = [tmp_path / d for d in ("skip", "heal", "clean")]
    for d in dirs:
        d.mkdir()
    # One after the other, in this process (`guarded`): an in-process run owns the process's
    # hooks and signal handler while it runs.
    return (guarded(dirs[0], SCRIPT, "--corrupt-at", BAD, policy="skip"),
            guarded(dirs[1], SCRIPT, "--corrupt-at", BAD, policy="heal"),
            guarded(dirs[2], SCRIPT))


def test_bad_batches_named_skipped_clipped_and_the_clean_run_quiet(tmp_path: Path) -> None:
    skip, heal, clean = _runs(tmp_path)
    truth = _truth(skip)
    assert sorted(truth) == [70, 110, 140] and _truth(heal) == truth

    rep = skip.report
    assert rep["status"] == "recovered", skip.explain()
    assert {a["step"] for a in rep["alarms"]} == set(truth), skip.explain()
    assert all(a.get("cause") == "bad_batch" for a in rep["alarms"])
    skips = [a for a in rep["actions"] if a["action"] == "skip"]
    assert [a["step"] for a in skips] == sorted(truth)
    assert all("a bad batch (batch " in a["detail"] for a in skips)
    spikes = {s["step"]: s for s in rep["spikes"]}
    assert set(spikes) == set(truth)
    for step, rows in truth.items():
        assert spikes[step]["cause"] == "bad_batch"
        assert re.fullmatch(r"[0-9a-f]{13}", spikes[step]["batch"])
        assert spikes[step]["rows"] == rows, (step, spikes[step])

    causes = [d["cause"] for d in rep["diagnosis"]]
    assert causes[0] == "bad_batch" and "optimizer_divergence" not in causes, causes

    rep = heal.report
    assert rep["status"] != "healthy"
    assert not [a for a in rep["actions"] if a["action"] in ("lr_cut", "wd_cut")], heal.explain()
    h = rep["run"]["recovery"]["heal"]
    assert h["bad_batches"] == sorted(truth) and h["lr_factor"] == 1.0 and not h["cuts"]

    rep = clean.report
    assert rep["status"] == "healthy" and not rep["alarms"] and not rep["actions"], \
        clean.explain()


def test_rows_of_a_heavily_corrupted_batch_are_each_named(tmp_path: Path) -> None:
    """14 of 32 rows corrupted: the batch's own median and MAD no longer describe a clean row
    (the MAD is inflated by the corrupted rows), so the rows are judged against the loss's
    level before the spike. Every corrupted row is named and no clean one."""
    run = guarded(tmp_path, SCRIPT, "--corrupt-at", "110", "--bad-rows", "16", "--iters", "120",
                  policy="skip")
    truth = _truth(run)
    assert list(truth) == [110] and len(truth[110]) == 16
    spikes = {s["step"]: s for s in run.report["spikes"]}
    assert spikes[110]["cause"] == "bad_batch", run.explain()
    assert spikes[110]["rows"] == truth[110], spikes[110]


def test_row_losses_judged_against_the_level_before_the_spike() -> None:
    """The estimator itself (`pinpoint.spike.norm_outliers`), on row losses made here: 18
    clean rows spread around the loss's level (log-normal, sigma 0.1), 14 rows at 1.6-2.4x it.
    Against the level every corrupted row is named and no clean one; the batch's own median
    and MAD name only some; with fewer than 3 rows at or below the level (a level in other
    units) the batch's own estimate is used."""
    import torch

    from nanguard.pinpoint.spike import norm_outliers

    g = torch.Generator().manual_seed(0)
    level = 1.5
    clean = (level * torch.exp(0.1 * torch.randn(18, generator=g, dtype=torch.float64))).tolist()
    bad = (level * torch.linspace(1.6, 2.4, 14, dtype=torch.float64)).tolist()
    order = torch.randperm(32, generator=g).tolist()
    losses = [0.0] * 32
    for i, v in zip(order, clean + bad, strict=True):
        losses[i] = v
    truth = sorted(order[18:])

    named = sorted(d["index"] for d in norm_outliers(losses, 3.5, level))
    assert named == truth
    own = sorted(d["index"] for d in norm_outliers(losses, 3.5))
    assert set(own) < set(truth)  # the inflated MAD misses corrupted rows, names no clean one
    assert norm_outliers(losses, 3.5, level / 10) == norm_outliers(losses, 3.5)
