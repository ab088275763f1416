"""Re-run verdicts under DDP with 2 real gloo processes. The step's gradients are the ranks'
average, which no re-run of one rank's batch gives: a rank's own re-run compares the loss
alone (and says so), and the re-run's backward skips DDP's all-reduce. Before, every DDP spike
was called `transient` ("suspect the hardware") because the local re-run's gradients never
equal the averaged ones; and a replay on one rank alone ran DDP's all-reduce, which paired
with the other rank's training all-reduce.

Then the alarmed rank's batch is re-run on the other rank too (`pinpoint.xrank`), and every
rank records the same verdict. Expected verdicts come from what was planted, on rank 1 alone:
a batch scaled by 300 gives the same bits anywhere (`reproducible`); a bit flipped once in its
forward does not re-run there (`transient`); a bit flipped in every forward from step 25 on,
re-runs included, repeats on rank 1 but not on rank 0 (`persistent` on rank 1). Training must
not depend on the check: the final parameters and buffers are the same bytes with it off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from _run import env, free_port

WORKER = Path(__file__).resolve().parent / "rerun_worker.py"


def _launch(tmp_path: Path, mode: str, policy: str = "observe", cross: str = "1"
            ) -> list[dict]:
    port = str(free_port())
    out = tmp_path / f"{mode}-{policy}-{cross}"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out), str(rank), port, mode,
                               policy, cross],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    results = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            line = next(s for s in stdout.splitlines() if s.startswith("RESULT "))
            results.append(json.loads(line.removeprefix("RESULT ")))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by this test's own child's pid
    return results


def _first_rerun(res: dict) -> dict:
    step, rerun = res["reruns"][0]
    assert step == 25, res
    return rerun


def test_a_data_spike_under_ddp_is_reproducible_on_every_rank(tmp_path: Path) -> None:
    results = _launch(tmp_path, "data")
    for res in results:
        assert (25, "spike") in [tuple(a) for a in res["alarms"]]
        rerun = _first_rerun(res)
        assert rerun["verdict"] == "reproducible", rerun
        assert rerun["grads_compared"] is False and "averaged across ranks" in rerun["why"]
        assert "nondeterministic" not in res["causes"]
        # Rank 1's batch (the one scaled, its own gradients the largest) re-ran on rank 0 too:
        # the same loss and gradient fingerprint, bit for bit.
        cross = rerun["cross_rank"]
        assert (cross["rank"], cross["peer"], cross["verdict"]) == (1, 0, "reproducible")
        assert cross["loss_same"] and cross["grads_same"]
    # Observing changes nothing: the same run without any re-run (under `observe` the check
    # adds a per-step agreement; the replays run DDP's forward) ends with the same parameter
    # and BatchNorm buffer bytes on every rank.
    assert {r["params"] for r in _launch(tmp_path, "data", cross="none")} == \
        {r["params"] for r in results}


def test_a_flip_in_rank_1s_forward_is_transient_there(tmp_path: Path) -> None:
    r0, r1 = _launch(tmp_path, "flip")
    assert r1["fired"] and not r0["fired"], (r1["flip"], r1["first"], r1["reruns"])
    assert _first_rerun(r1)["verdict"] == "transient" and not _first_rerun(r1)["loss_same"]
    assert r1["causes"][0] == "nondeterministic", (r1["flip"], r1["first"], r1["causes"])
    # Rank 1's replay of step 25 (its loss went non-finite, rank 0's did not) runs no DDP
    # all-reduce: one used to pair with rank 0's next training all-reduce, and the finding
    # read "phase data, op aten.allreduce_" in about 2 runs of 5.
    assert r1["first"]["step"] == 25 and r1["first"]["verdict"] == "transient"
    assert r1["first"]["phase"] != "data" and r1["first"].get("op") != "aten.allreduce_"
    # Rank 0's own batch re-runs the same, but the step's alarm was rank 1's (its own re-run
    # differed): both ranks record rank 1's verdict, rank 0 its own as `local_verdict`.
    assert _first_rerun(r0)["local_verdict"] == "reproducible"
    for res in (r0, r1):
        rerun = _first_rerun(res)
        assert rerun["verdict"] == "transient" and rerun["cross_rank"]["rank"] == 1, rerun
        assert res["causes"][0] == "nondeterministic", res["causes"]


def test_a_fault_that_repeats_on_rank_1_is_persistent_there(tmp_path: Path) -> None:
    r0, r1 = _launch(tmp_path, "persistent")
    assert r1["fired"] and not r0["fired"], r1["flip"]
    for res in (r0, r1):
        # Rank 1 repeats its own overflow; rank 0 computes rank 1's batch from the same
        # parameters and RNG states and gets another loss: rank 1's device.
        rerun = _first_rerun(res)
        assert rerun["verdict"] == "persistent" and rerun["rank"] == 1, rerun
        cross = rerun["cross_rank"]
        assert (cross["rank"], cross["peer"]) == (1, 0) and not cross["loss_same"], cross
        assert (25, "replica_divergence") in [tuple(a) for a in res["alarms"]]
        assert res["causes"][0] == "replica_divergence", res["causes"]
        assert "persistent on rank 1" in res["evidence"]["replica_divergence"]
        assert "nondeterministic" not in res["causes"]
    # Rank 1 alone saw nothing wrong: its own re-run repeated the step bit for bit.
    assert _first_rerun(r1)["local_verdict"] == "reproducible"
    assert (r1["first"]["step"], r1["first"]["verdict"]) == (25, "persistent")


def test_the_check_rides_an_acting_policys_agreement_and_changes_no_update(
        tmp_path: Path) -> None:
    on = _launch(tmp_path, "data", policy="skip")
    for res in on:
        assert _first_rerun(res)["cross_rank"]["verdict"] == "reproducible"
    off = _launch(tmp_path, "data", policy="skip", cross="0")  # each rank re-runs its own
    assert "cross_rank" not in _first_rerun(off[0]) and _first_rerun(off[0])["verdict"]
    assert {r["params"] for r in on} == {r["params"] for r in off}
