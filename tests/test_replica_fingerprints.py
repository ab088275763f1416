"""`nanguard.watch.replicas` without processes: the fingerprint changes with any single flipped
bit (every bit position, every float dtype) and with nothing else, and the verdict names the
ranks that disagree with the majority (ties to the lowest rank) and their tensors, from
gathered values faked in a one-process gloo group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nanguard.testing import flip_bit
from nanguard.watch import replica_prints, replicas


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_any_single_bit_changes_the_fingerprint(dtype):
    torch.manual_seed(0)
    # Odd element counts (2-byte elements widened one by one) and an even one (read as words).
    params = [torch.randn(7, 5).to(dtype), torch.randn(3).to(dtype), torch.randn(4, 4).to(dtype)]
    base = replicas.combine(replicas.tensor_fingerprints(params))
    assert replicas.combine(replicas.tensor_fingerprints([p.clone() for p in params])) == base
    clean = replicas.tensor_fingerprints(params)
    for which, index in ((1, (2,)), (2, (3, 1))):
        for bit in range(torch.finfo(dtype).bits):
            copy = [p.clone() for p in params]
            flip_bit(copy[which], index, bit)
            per_tensor = replicas.tensor_fingerprints(copy)
            assert replicas.combine(per_tensor) != base, (which, bit)
            assert torch.nonzero(per_tensor != clean).flatten().tolist() == [which]


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _fake_world(monkeypatch, per_rank: list[list[int]], layouts: list[int] | None = None):
    """Make `compare` see these per-tensor fingerprints (one list per rank) as gathered."""
    rows = [torch.tensor(v, dtype=torch.int64) for v in per_rank]
    calls = []

    def gather(vector: torch.Tensor) -> list[torch.Tensor]:
        calls.append(vector.numel())
        if len(calls) == 1:  # the head: (combined, count, layout)
            return [torch.stack([replicas.combine(r), torch.tensor(len(r)),
                                 torch.tensor((layouts or [0] * len(rows))[i])])
                    for i, r in enumerate(rows)]  # fmt: skip
        return rows

    monkeypatch.setattr(replica_prints, "_gather", gather)  # where `compare` gathers
    return calls


NAMES = ["a.weight", "a.bias", "b.weight"]
PARAMS = [torch.zeros(1)] * 3


def test_majority_and_tensors(one_process_group, monkeypatch):
    calls = _fake_world(monkeypatch, [[1, 2, 3], [1, 2, 3], [1, 9, 8], [1, 2, 3]])
    found = replicas.compare(41, NAMES, PARAMS)
    assert found is not None and calls == [3, 3]  # the second gather only on a mismatch
    assert (found.step, found.ranks, found.reference) == (41, [2], [0, 1, 3])
    assert found.tensors == {2: ["a.bias", "b.weight"]}
    assert "rank 2 in a.bias, b.weight (reference: rank(s) 0, 1, 3)" in found.message()
    assert found.alarm().kind == "replica_divergence"


def test_tie_goes_to_the_lowest_rank_and_agreement_is_silent(one_process_group, monkeypatch):
    _fake_world(monkeypatch, [[5, 6], [5, 7]])
    found = replicas.compare(3, NAMES[:2], PARAMS[:2])
    assert found is not None and (found.ranks, found.reference) == ([1], [0])
    calls = _fake_world(monkeypatch, [[5, 6], [5, 6]])
    assert replicas.compare(3, NAMES[:2], PARAMS[:2]) is None and calls == [3]


def test_different_layouts_are_not_replicas(one_process_group, monkeypatch):
    _fake_world(monkeypatch, [[1, 2], [1, 2]], layouts=[7, 8])
    with pytest.raises(ValueError, match="not data-parallel replicas"):
        replicas.compare(0, NAMES[:2], PARAMS[:2])


class _Guard:
    """The few members of a Guard that the replica check uses."""

    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(2))]
        self.model = torch.nn.Module()  # not a DDP: a difference at the start means no replicas
        self.param_names = ["w"]
        self.optimizer = torch.optim.SGD(self.params, lr=0.1)
        self.step, self.error, self.closed = 0, None, False
        self.alarms: list = []

    def record_alarm(self, alarm) -> None:
        self.alarms.append(alarm)


def _steps(guard: _Guard, n: int) -> None:
    for _ in range(n):
        guard.optimizer.step()
        guard.step += 1


def test_check_cadence_first_step_and_no_repeats(one_process_group, monkeypatch):
    # Before step 0's update, then after steps 0, 3, 7, 11, 15.
    verdicts = iter([None, None, "d", "d", None, "d"])
    seen = []

    def fake_compare(step, names, params):
        seen.append(step)
        v = next(verdicts)
        return v and replicas.ReplicaDivergence(step=step, ranks=[1], reference=[0],
                                                tensors={1: ["w"]})  # fmt: skip

    monkeypatch.setattr(replicas, "compare", fake_compare)
    guard = _Guard()
    check = replicas.ReplicaCheck(guard, every=4)
    _steps(guard, 16)
    assert seen == [0, 0, 3, 7, 11, 15] and check.checks == 6
    # Step 7 repeats step 3's divergence: said once; after agreeing again (11) it is new.
    assert [a.step for a in guard.alarms] == [3, 15]
    guard.closed = True
    _steps(guard, 1)  # the hook removes itself once the guard is closed
    assert not guard.optimizer._optimizer_step_post_hooks
    assert not guard.optimizer._optimizer_step_pre_hooks


@pytest.mark.parametrize("why", ["missing_rank", "differ_from_the_start"])
def test_check_turns_itself_off(one_process_group, monkeypatch, why, caplog):
    calls = []
    if why == "missing_rank":
        monkeypatch.setattr(replicas, "ranks_without_check", lambda: [1])
    divergence = replicas.ReplicaDivergence(step=0, ranks=[1], reference=[0])
    monkeypatch.setattr(replicas, "compare", lambda *a: calls.append(a) or divergence)
    guard = _Guard()
    check = replicas.ReplicaCheck(guard, every=4)
    _steps(guard, 12)
    assert guard.alarms == [] and check.every == 0
    assert len(calls) == (0 if why == "missing_rank" else 1)  # no collective for a missing rank
    assert "replica check off" in caplog.text
