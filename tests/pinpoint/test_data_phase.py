"""Ops that only load the batch (a Dataset's `torch.tensor(rows)`, the collate's `stack`, `.to`,
`.float()`, indexing) are phase `data`, and a NaN they carry is an input the batch holds, not a
value some op made; a `-inf` mask built the same way stays intended."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nanguard.explain.evidence import Evidence
from nanguard.explain.rules import data_nonfinite
from nanguard.pinpoint.replay import find_origin

ROWS = [[math.sin(i / 3), math.cos(i / 5), 0.1 * i] for i in range(40)]
ROWS[17][1] = math.nan  # a gap in one column


class Windows(Dataset):
    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows) - 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(self.rows[i:i + 4], dtype=torch.float64)


def _step(model: nn.Module, rows: list[list[float]], start: int):  # type: ignore[no-untyped-def]
    """Build batch `start // 8` through a real DataLoader (its collate), then one step."""
    def run() -> None:
        loader = DataLoader(Windows(rows), batch_size=8)
        batch = list(loader)[start // 8]
        x = batch.to("cpu").float()
        model(x.flatten(1)).pow(2).mean().backward()
    return run


def test_a_nan_read_from_python_rows_is_data_in_the_rows_of_the_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(12, 1)
    # Window i covers rows i..i+3: windows 14..17 hold row 17; batch 1 is windows 8..15.
    origin = find_origin(_step(model, ROWS, 8), model=None)
    assert origin is not None
    assert (origin.phase, origin.kind, origin.op, origin.samples) == (
        "data", "input", "aten.stack", [6, 7])
    ev = Evidence(first_nonfinite=origin.to_dict(), entry="run")
    cause = data_nonfinite(ev)
    assert cause is not None and cause.cause == "data_nonfinite"


def test_clean_rows_find_nothing() -> None:
    torch.manual_seed(0)
    clean = [r[:] for r in ROWS]
    clean[17][1] = 0.5
    assert find_origin(_step(nn.Linear(12, 1), clean, 8), model=None) is None


def test_an_inf_mask_from_python_values_stays_intended() -> None:
    """`torch.tensor([[0, -inf], ...])` stacked and added to scores: a mask, never an origin
    (no NaN); the softmax that turns a fully masked row into NaN is."""
    def run() -> None:
        rows = [torch.tensor([0.0, -math.inf, 0.0]), torch.tensor([-math.inf] * 3)]
        mask = torch.stack(rows)
        scores = torch.zeros(2, 3, requires_grad=True)
        torch.softmax(scores + mask, dim=-1).sum().backward()

    origin = find_origin(run, model=None)
    assert origin is not None
    assert origin.op == "aten._softmax" and origin.kind == "op"
