"""House-price regression on tabular listings: the model takes raw listing features (living
area in m2, rooms, age in years, distance to the centre in km), log-transforms the skewed ones
inside its forward (prices scale with log-area), standardizes with statistics of the training
set and predicts the log price with an MLP. Shuffled DataLoader, AdamW, a cosine schedule.
Like many research codebases, the forward checks its own hidden state and raises on a
non-finite value instead of training on it.

    python house_prices.py --epochs 2
    python house_prices.py --zero-area 300        # fails: the script's own NaN check raises
    python house_prices.py --extra-column-at 5    # fails: a shape error, nothing non-finite

How it fails: `--zero-area I`: listing I has an area of 0 (a missing value exported as 0);
`log(area)` is -inf there, the MLP's first layer turns it into NaN/Inf and the forward's
check raises `FloatingPointError` in the batch holding it (log of a non-positive value).
`--extra-column-at K`: from update step K on the loader yields one more feature column than
the model was built for (a schema change in the middle of the data): the first Linear raises
a shape error; nothing non-finite ever appears.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

N_LISTINGS = 512
BATCH = 32


def make_listings(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Listings (area, rooms, age, distance) and their log prices."""
    g = torch.Generator().manual_seed(seed)
    area = 30 + 170 * torch.rand(n, generator=g)
    rooms = torch.clamp((area / 30).round() + torch.randint(-1, 2, (n,), generator=g), min=1)
    age = 80 * torch.rand(n, generator=g)
    dist = 0.5 + 20 * torch.rand(n, generator=g)
    log_price = (8.0 + 0.9 * torch.log(area) + 0.03 * rooms - 0.004 * age
                 - 0.25 * torch.log(dist) + 0.05 * torch.randn(n, generator=g))
    return torch.stack([area, rooms, age, dist], dim=1), log_price.unsqueeze(1)


def loader(features: torch.Tensor, target: torch.Tensor, seed: int) -> DataLoader:
    """Shuffled mini-batches; the order is fixed by `seed` (the tests recompute it)."""
    return DataLoader(TensorDataset(features, target), batch_size=BATCH, shuffle=True,
                      drop_last=True, generator=torch.Generator().manual_seed(seed))


class PriceNet(nn.Module):
    LOG_COLUMNS = (0, 3)  # area, distance

    def __init__(self, n_features: int, hidden: int, mean: torch.Tensor,
                 std: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", mean)
        self.register_buffer("std", std)
        self.mlp = nn.Sequential(nn.Linear(n_features, hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.GELU())
        self.head = nn.Linear(hidden, 1)

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        for c in self.LOG_COLUMNS:
            x[:, c] = torch.log(x[:, c])
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (self.transform(x) - self.mean) / self.std
        h = self.mlp(z)
        if not torch.isfinite(h).all():
            raise FloatingPointError("PriceNet: non-finite hidden state "
                                     f"({int((~torch.isfinite(h)).any(1).sum())} rows)")
        return self.head(h)


def main() -> None:
    p = argparse.ArgumentParser(description="house-price regression with an MLP")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--zero-area", type=int, default=None, help="listing whose area is 0")
    p.add_argument("--extra-column-at", type=int, default=None,
                   help="from this update step on, batches carry one more column")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    features, log_price = make_listings(N_LISTINGS, args.seed)
    if args.zero_area is not None:
        features[args.zero_area, 0] = 0.0
    clean = features[features[:, 0] > 0]
    logged = clean.clone()
    logged[:, list(PriceNet.LOG_COLUMNS)] = logged[:, list(PriceNet.LOG_COLUMNS)].log()
    model = PriceNet(features.shape[1], args.hidden, logged.mean(0), logged.std(0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr,
                                  weight_decay=args.weight_decay)
    steps = args.epochs * (N_LISTINGS // BATCH)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    # the target standardized too (the MLP's output starts near 0)
    target = (log_price - log_price.mean()) / log_price.std()
    data = loader(features, target, args.seed)
    step = 0
    for epoch in range(args.epochs):
        total = 0.0
        for x, y in data:
            if args.extra_column_at is not None and step >= args.extra_column_at:
                x = torch.cat([x, torch.ones(len(x), 1)], dim=1)
            if tracer:
                tracer.start(x)
            pred = model(x)
            loss = nn.functional.mse_loss(pred, y)
            if tracer:
                tracer.loss(loss)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if tracer:
                tracer.grads()
            optimizer.step()
            schedule.step()
            if tracer:
                tracer.updated()
            total += loss.item()
            step += 1
        print(f"epoch {epoch}: mse {total / (N_LISTINGS // BATCH):.4f}")


if __name__ == "__main__":
    main()
