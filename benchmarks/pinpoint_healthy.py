"""Cost of the op-level checker on a HEALTHY step (checked all the way through, no early stop):
a small transformer LM step with and without `find_origin`, interleaved, medians.

    PYTHONPATH=src python benchmarks/pinpoint_healthy.py

The last line printed is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from torch import nn

from nanguard.pinpoint import find_origin


def main(rounds: int = 9) -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, 256, batch_first=True)
    model = nn.Sequential(nn.Embedding(512, 128), nn.TransformerEncoder(layer, 2),
                          nn.Linear(128, 512))
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x, y = torch.randint(0, 512, (8, 64)), torch.randint(0, 512, (8, 64))

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 512), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    for _ in range(3):
        step()
    plain, checked = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        step()
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        origin = find_origin(step, model=model, optimizer=opt, batch=(x, y))
        checked.append(time.perf_counter() - t)
        assert origin is None, "a healthy step must have no origin"
    result = {"plain_ms": statistics.median(plain) * 1e3,
              "checked_ms": statistics.median(checked) * 1e3}
    result["ratio"] = result["checked_ms"] / result["plain_ms"]
    print(f"healthy LM step (2 layers, d_model 128, seq 64, batch 8, AdamW): plain "
          f"{result['plain_ms']:.1f} ms, under the checker {result['checked_ms']:.1f} ms, "
          f"{result['ratio']:.2f}x")
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))
    return result


if __name__ == "__main__":
    main()
