"""Which rank's batch a cross-rank re-run takes (`pinpoint.xrank.priority`), and the batch's
structure surviving the trip (`_split` / `_map`), without a process group: the 2-process
runs are in tests/integrations/test_rerun_ddp.py.

Under DDP a gradient spike shows on every rank (the gradients are averaged), so the suspect
must come from what is a rank's own: a re-run that differed there, its own loss, the size of
its own re-run's gradients. Expected orderings follow from that, not from the code's numbers.
"""

from __future__ import annotations

import pickle
from collections import namedtuple

import torch

from nanguard.pinpoint.xrank import _map, _Slot, _split, priority

Pair = namedtuple("Pair", "x y")  # module level: the header pickles it by name


def test_a_rank_asks_only_with_a_verdict() -> None:
    assert priority(None, own_loss=True) == 0
    assert priority({"verdict": None, "why": "several micro-batches"}, own_loss=True) == 0
    assert priority({"verdict": "reproducible"}, own_loss=False) > 0


def test_the_rank_whose_step_ran_differently_comes_first() -> None:
    transient = priority({"verdict": "transient", "local_grad_norm": 1.0}, own_loss=False)
    own_loss = priority({"verdict": "reproducible", "local_grad_norm": 1e30}, own_loss=True)
    big = priority({"verdict": "reproducible", "local_grad_norm": float("inf")}, own_loss=False)
    small = priority({"verdict": "reproducible", "local_grad_norm": 3.0}, own_loss=False)
    assert transient > own_loss > big > small > 0
    # A `transient` that a non-finite gradient brought through the all-reduce says nothing of
    # this rank: it ranks like any other request.
    borrowed = priority({"verdict": "transient"}, own_loss=False, transient_counts=False)
    assert borrowed < small


def test_a_batch_keeps_its_structure_and_tensors() -> None:
    batch = {"inputs": Pair(torch.arange(6.0).reshape(2, 3), torch.tensor([1, 0])),
             "mask": [torch.ones(2, dtype=torch.bool)], "note": "ids 4-5"}
    tensors: list[torch.Tensor] = []
    header = pickle.loads(pickle.dumps(_split(batch, tensors)))  # what travels
    slots: list[_Slot] = []
    _map(header, _Slot, slots.append)
    assert [(s.shape, s.dtype) for s in slots] == [(tuple(t.shape), t.dtype) for t in tensors]
    back = _map(header, _Slot, lambda s: tensors[s.i].clone())
    assert isinstance(back["inputs"], Pair) and back["note"] == "ids 4-5"
    assert torch.equal(back["inputs"].x, batch["inputs"].x)
    assert torch.equal(back["inputs"].y, batch["inputs"].y)
    assert torch.equal(back["mask"][0], batch["mask"][0])
