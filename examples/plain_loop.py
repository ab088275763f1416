"""The smallest guarded training loop: two extra lines, one optional `watch` call.

Run: python examples/plain_loop.py   (then: nanguard report runs/plain_loop)
"""

import torch
from torch import nn

import nanguard


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # An explicit folder that already holds a run is refused unless asked: overwrite it.
    config = nanguard.GuardConfig(record=nanguard.RecordConfig(if_exists="overwrite"))
    with nanguard.Guard(model, optimizer, out="runs/plain_loop", config=config) as guard:
        for step in range(200):
            x = torch.randn(64, 8)
            y = x.sum(dim=1, keepdim=True)
            if step == 150:
                x[7, 2] = float("nan")  # a bad row, as a real loader sometimes yields
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


if __name__ == "__main__":
    main()
