"""Multi-horizon load forecast from a CSV of hourly station readings with a small temporal
convolution network (dilated causal Conv1d), in the plain style of many forecasting repos: the
CSV is parsed into Python lists once, and the `Dataset` builds each window with
`torch.tensor(rows[i:i + window])` when it is asked for it (float64, as parsed); the training
loop moves the batch with `.to(device).float()`. Shuffled DataLoader, AdamW, Huber loss.

    python station_tcn.py --csv load.csv --max-iters 40

CSV format: a header row, a `timestamp` column (ignored) and numeric columns; an empty cell
is read as NaN (how a logger's export marks a gap).

How it fails: a gap in the readings (a few consecutive empty cells of one column): every
window that covers it holds NaN, and the first shuffled batch holding such a window carries
it into the model (non-finite data). No op computes the value: the window is built from the
parsed lists, stacked by the collate function and cast by `.float()`.
"""

from __future__ import annotations

import argparse
import csv
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


def read_rows(path: str) -> tuple[list[str], list[list[float]]]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        cols = [i for i, name in enumerate(header) if name != "timestamp"]
        rows = [[float(r[i]) if r[i].strip() else float("nan") for i in cols] for r in reader]
    return [header[i] for i in cols], rows


class Windows(Dataset):
    """Window i: rows i .. i+window-1 (all columns); target: the next `horizon` values of the
    target column."""

    def __init__(self, rows: list[list[float]], target: int, window: int, horizon: int) -> None:
        self.rows, self.target, self.window, self.horizon = rows, target, window, horizon

    def __len__(self) -> int:
        return len(self.rows) - self.window - self.horizon + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor(self.rows[i:i + self.window], dtype=torch.float64)
        end = i + self.window
        y = torch.tensor([r[self.target] for r in self.rows[end:end + self.horizon]],
                         dtype=torch.float64)
        return x, y


def loader(dataset: Dataset, batch_size: int, seed: int) -> DataLoader:
    """The training loader (the tests recompute its order from the same generator)."""
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))


class CausalBlock(nn.Module):
    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.pad = 2 * dilation
        self.conv = nn.Conv1d(channels, channels, 3, dilation=dilation)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.conv(nn.functional.pad(x, (self.pad, 0))))


class TCN(nn.Module):
    def __init__(self, n_features: int, channels: int, horizon: int) -> None:
        super().__init__()
        self.inp = nn.Conv1d(n_features, channels, 1)
        self.blocks = nn.Sequential(*[CausalBlock(channels, d) for d in (1, 2, 4)])
        self.head = nn.Linear(channels, horizon)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.inp(x.transpose(1, 2)))  # (batch, channels, time)
        return self.head(h[:, :, -1])


def main() -> None:
    p = argparse.ArgumentParser(description="TCN load forecast from a CSV")
    p.add_argument("--csv", required=True)
    p.add_argument("--target", default="load")
    p.add_argument("--window", type=int, default=12)
    p.add_argument("--horizon", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    names, rows = read_rows(args.csv)
    data = Windows(rows, names.index(args.target), args.window, args.horizon)
    train = loader(data, args.batch_size, args.seed)
    model = TCN(len(names), args.channels, args.horizon).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    criterion = nn.HuberLoss()

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    it = 0
    for epoch in range(args.epochs):
        for x, y in train:
            if it >= args.max_iters:
                break
            x, y = x.to(device).float(), y.to(device).float()
            if tracer:
                tracer.start(x)
            loss = criterion(model(x), y)
            if tracer:
                tracer.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            if tracer:
                tracer.grads()
            optimizer.step()
            if tracer:
                tracer.updated()
            it += 1
            if it % 10 == 0:
                print(f"epoch {epoch} iter {it}: loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
