"""Customer-churn classifier on tabular features: the model normalizes its raw inputs with a
`BatchNorm1d` first layer (no separate scaler), then an MLP with a logit output and
`BCEWithLogitsLoss`. Shuffled DataLoader, Adam, several epochs; no checkpoint anywhere.

    python churn_bn.py --epochs 3
    python churn_bn.py --missing-income 7      # fails

How it fails: `--missing-income I`: customer I has no income on record (NaN, as a join with a
missing row gives). The first batch holding that customer puts NaN through BatchNorm: its
output, the loss and every gradient go NaN, and so do its running mean and variance, which
BatchNorm writes during that forward, before the first update (non-finite data; nothing was
loaded).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

N_CUSTOMERS = 400
BATCH = 32
FEATURES = ("tenure_months", "monthly_charges", "income", "support_calls", "age")


def make_customers(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tenure = 72 * torch.rand(n, generator=g)
    charges = 20 + 100 * torch.rand(n, generator=g)
    income = 20_000 + 80_000 * torch.rand(n, generator=g)
    calls = torch.poisson(2 * torch.ones(n), generator=g)
    age = 18 + 60 * torch.rand(n, generator=g)
    logit = 1.5 - 0.05 * tenure + 0.02 * charges + 0.4 * calls - income / 50_000
    churn = (torch.rand(n, generator=g) < torch.sigmoid(logit)).float()
    return torch.stack([tenure, charges, income, calls, age], dim=1), churn.unsqueeze(1)


def loader(x: torch.Tensor, y: torch.Tensor, seed: int) -> DataLoader:
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True, drop_last=True,
                      generator=torch.Generator().manual_seed(seed))


def main() -> None:
    p = argparse.ArgumentParser(description="churn classifier with a BatchNorm input layer")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--missing-income", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    x, y = make_customers(N_CUSTOMERS, args.seed)
    if args.missing_income is not None:
        x[args.missing_income, FEATURES.index("income")] = float("nan")
    model = nn.Sequential(nn.BatchNorm1d(len(FEATURES)), nn.Linear(len(FEATURES), 32),
                          nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.BCEWithLogitsLoss()

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    data = loader(x, y, args.seed)
    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for xb, yb in data:
            if tracer:
                tracer.start(xb)
            loss = criterion(model(xb), yb)
            if tracer:
                tracer.loss(loss)
            optimizer.zero_grad()
            loss.backward()
            if tracer:
                tracer.grads()
            optimizer.step()
            if tracer:
                tracer.updated()
            total += loss.item()
        model.eval()
        with torch.no_grad():
            acc = ((model(x) > 0).float() == y).float().mean().item()
        print(f"epoch {epoch}: loss {total / (N_CUSTOMERS // BATCH):.4f} accuracy {acc:.3f}")


if __name__ == "__main__":
    main()
