"""Regression from a data file: an MLP fitted to (features, target) read from CSV (NumPy),
`.npz` (NumPy) or `.pt` (`torch.load`), batched by a DataLoader.

    python file_regression.py --data train.csv [--epochs 3] [--batch 16] [--lr 1e-3]
    python file_regression.py --make FILE [--nan-row R --nan-col C] [--huge R]  # a data file

The file holds rows of 4 features and a target (the last column; `.npz` / `.pt`: arrays or
tensors `x` and `y`). `--make` writes one from a fixed seed; `--nan-row R --nan-col C` leaves
that cell NaN (C = 4: the target); `--huge R` writes 1e40 into row R's first feature (a unit
mix-up: fine in the file's float64, beyond float32). The script prints `NOTE nan in COLUMN at
update K` (K = Adam steps before the batch that holds it) the first time a batch holds one,
and `NOTE beyond float32 in the file` when its float64 values exceed float32's range, from
its own checks; the training itself does not look.

`--norm batch` standardises each batch's features by the batch's own mean and std: with 96
rows and `--batch 19` the last batch of an epoch holds one row, and `std` of one row divides
by n - 1 = 0 (the script prints `NOTE batch of 1 at update K`).
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def make(path: str, nan_row: int | None, nan_col: int, huge: int | None) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 4))
    y = x @ np.array([0.5, -1.0, 2.0, 0.1]) + 0.1 * rng.normal(size=96)
    table = np.concatenate([x, y[:, None]], axis=1)
    if nan_row is not None:
        table[nan_row, nan_col] = math.nan
    if huge is not None:
        table[huge, 0] = 1e40
    if path.endswith(".csv"):
        np.savetxt(path, table, delimiter=",", header="a,b,c,d,target", comments="",
                   fmt="%.6g")
    elif path.endswith(".npz"):
        np.savez(path, x=table[:, :4], y=table[:, 4])
    else:
        torch.save({"x": torch.tensor(table[:, :4], dtype=torch.float32),
                    "y": torch.tensor(table[:, 4], dtype=torch.float32)}, path)


def read(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    if path.endswith(".csv"):
        table = np.genfromtxt(path, delimiter=",", skip_header=1)  # an empty cell is NaN
        if np.abs(table[np.isfinite(table)]).max() > np.finfo(np.float32).max:
            print("NOTE beyond float32 in the file", flush=True)
        return torch.from_numpy(table[:, :4]).float(), torch.from_numpy(table[:, 4]).float()
    if path.endswith(".npz"):
        arrays = np.load(path)
        return torch.from_numpy(arrays["x"]).float(), torch.from_numpy(arrays["y"]).float()
    data = torch.load(path, weights_only=True)
    return data["x"], data["y"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=None)
    p.add_argument("--make", default=None)
    p.add_argument("--nan-row", type=int, default=None)
    p.add_argument("--nan-col", type=int, default=0)
    p.add_argument("--huge", type=int, default=None)
    p.add_argument("--norm", choices=("none", "batch"), default="none")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="0: the whole file, no DataLoader")
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    if args.make:
        make(args.make, args.nan_row, args.nan_col, args.huge)
        return

    torch.manual_seed(0)
    x, y = read(args.data)
    loader = (DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True)
              if args.batch else [(x, y)])
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    updates, noted, done = 0, False, set()
    for epoch in range(args.epochs):
        for xb, yb in loader:
            if not noted and not bool(torch.isfinite(xb).all() & torch.isfinite(yb).all()):
                noted = True
                col = "target" if not bool(torch.isfinite(yb).all()) else "features"
                print(f"NOTE nan in {col} at update {updates}", flush=True)
            if args.norm == "batch":
                if len(xb) == 1 and "one" not in done:
                    done.add("one")
                    print(f"NOTE batch of 1 at update {updates}", flush=True)
                xb = (xb - xb.mean(0)) / (xb.std(0) + 1e-6)
            loss = nn.functional.mse_loss(model(xb)[:, 0], yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            updates += 1
        print(f"epoch {epoch} loss {loss.item():.4f}")
    print("done")


if __name__ == "__main__":
    main()
