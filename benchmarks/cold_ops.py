"""What a small tensor op costs right after a training step's heavy work, against the same op
repeated at once: why the guard's cost on host_cost.py's MLP is set by how many different
kernels it calls per step more than by what they compute (issue 39).

The MLP of host_cost.py (128-512-512-512-10, batch 128, SGD momentum) trains; after each
forward, ONE probe is timed (rotating through them, so each sees the same state of the caches):

    noop            an empty call (the timer's own cost)
    sum_item        x.sum().item() on the 128 x 128 input: the batch probe's finiteness total
    mv_int32        torch.mv of the input's int32 view with a weight vector: its fingerprints
    sum_then_mv     both, one after the other (the second is another kernel, not warmer)
    sum_twice       x.sum().item() twice: the second is the same kernel, warm
    warm_sum_item   x.sum().item() in a loop with nothing between (the textbook number)

Reported: the median of each (microseconds). On the 2-core VM of BENCHMARKS.md, an op after the
forward costs ~10x its warm time, and a second op of another kind pays again where a second op
of the same kind does not: the step's heavy work evicts the code and data of the small kernels
from the caches.

Usage:
    python benchmarks/cold_ops.py              # the run recorded in BENCHMARKS.md
    python benchmarks/cold_ops.py --rounds 120 # shorter
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=300, help="timed rounds per probe")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(128, 128), torch.randint(0, 10, (128,))
    w = torch.randint(0, 1 << 20, (128,), dtype=torch.int32)
    probes: dict[str, Callable[[], object]] = {
        "noop": lambda: None,
        "sum_item": lambda: x.sum().item(),
        "mv_int32": lambda: torch.mv(x.view(torch.int32), w),
        "sum_then_mv": lambda: (x.sum().item(), torch.mv(x.view(torch.int32), w)),
        "sum_twice": lambda: (x.sum().item(), x.sum().item()),
    }
    names = list(probes)
    times: dict[str, list[float]] = {k: [] for k in names}
    warmup = 10 * len(names)
    for i in range(warmup + args.rounds * len(names)):
        loss = nn.functional.cross_entropy(model(x), y)
        name = names[i % len(names)]
        t = time.perf_counter()
        probes[name]()
        if i >= warmup:
            times[name].append(time.perf_counter() - t)
        loss.backward()
        opt.step()
        opt.zero_grad()
    warm = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        x.sum().item()
        warm.append(time.perf_counter() - t)
    out = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    out["warm_sum_item"] = statistics.median(warm) * 1e6
    for k, v in out.items():
        print(f"{k:14s} {v:8.1f} us")
    print(json.dumps({"us": out, "rounds": args.rounds, "torch": torch.__version__}))


if __name__ == "__main__":
    main()
