"""Time-series forecaster trained from a CSV file: a `Dataset` of sliding windows over the
rows (all feature columns as input, the next value of the target column as label), a shuffled
`DataLoader`, a GRU (or an MLP over the flattened window) and Adam, with a validation split.

    python csv_forecaster.py --csv load.csv --target load --max-iters 80
    python csv_forecaster.py --csv load.csv --model mlp

CSV format: a header row, a `timestamp` column (ignored) and numeric columns.

How it fails: a CSV with an empty or `nan` cell in one row of a feature column (a sensor
dropout exported as NaN). Every window that covers that row carries the NaN into the model;
the first batch that holds such a window makes the loss and every gradient NaN, and Adam
spreads it into all weights (non-finite data).
"""

from __future__ import annotations

import argparse
import csv
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


def read_csv(path: str) -> tuple[list[str], torch.Tensor]:
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        cols = [i for i, name in enumerate(header) if name != "timestamp"]
        rows = [[float(r[i]) if r[i].strip() else float("nan") for i in cols] for r in reader]
    return [header[i] for i in cols], torch.tensor(rows, dtype=torch.float32)


class WindowDataset(Dataset):
    """Window i: rows i .. i+window-1 of every column; label: the target column at i+window."""

    def __init__(self, values: torch.Tensor, target_col: int, window: int) -> None:
        self.values = values
        self.target_col = target_col
        self.window = window

    def __len__(self) -> int:
        return len(self.values) - self.window

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.values[i:i + self.window]
        y = self.values[i + self.window, self.target_col:self.target_col + 1]
        return x, y


class GRUForecaster(nn.Module):
    def __init__(self, n_features: int, hidden: int) -> None:
        super().__init__()
        self.gru = nn.GRU(n_features, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x)
        return self.head(out[:, -1])


class MLPForecaster(nn.Module):
    def __init__(self, n_features: int, window: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(n_features * window, hidden),
                                 nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def main() -> None:
    p = argparse.ArgumentParser(description="forecast the next value of a CSV column")
    p.add_argument("--csv", required=True)
    p.add_argument("--target", default="load")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--model", choices=["gru", "mlp"], default="gru")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=80)
    p.add_argument("--val-frac", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    names, values = read_csv(args.csv)
    target_col = names.index(args.target)
    n_val = int(len(values) * args.val_frac)
    train_ds = WindowDataset(values[:-n_val], target_col, args.window)
    val_ds = WindowDataset(values[-n_val - args.window:], target_col, args.window)
    g = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, generator=g,
                              num_workers=args.num_workers, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size)
    print(f"{len(values)} rows, columns {names}; {len(train_ds)} train windows, "
          f"{len(val_ds)} val windows")

    if args.model == "gru":
        model: nn.Module = GRUForecaster(len(names), args.hidden)
    else:
        model = MLPForecaster(len(names), args.window, args.hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.MSELoss()

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    it = 0
    for epoch in range(args.epochs):
        model.train()
        running = 0.0
        for x, y in train_loader:
            if it >= args.max_iters:
                break
            if tracer:
                tracer.start(x)
            pred = model(x)
            loss = criterion(pred, y)
            if tracer:
                tracer.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            if tracer:
                tracer.grads()
            optimizer.step()
            if tracer:
                tracer.updated()
            running += loss.item()
            it += 1
            if it % 20 == 0:
                print(f"epoch {epoch} iter {it}: train loss {running / 20:.5f}")
                running = 0.0
        model.eval()
        with torch.no_grad():
            val = sum(criterion(model(x), y).item() * len(x) for x, y in val_loader)
        print(f"epoch {epoch}: val loss {val / len(val_ds):.5f}")
        if it >= args.max_iters:
            break


if __name__ == "__main__":
    main()
