"""Wall-time cost of the `heal` policy on the small GPT of benchmarks/spiky_lm.py: the same
training run back to back without nanguard, under `observe` and under `heal`, repeated with
the order rotated, so that load from other jobs falls on all three alike. The ratio to plain
is taken per repetition; the median over repetitions is reported.

At the stable LR (the default here) `heal` takes no action: the cost measured is that of
watching and deciding (the acting policies read the step's statistics on the host every step;
heal adds an EMA update and two comparisons). With `--lr 0.1` the runs differ (heal clips and
cuts), so the times are those of different trajectories of equal step count.

Usage:
    python benchmarks/spiky_overhead.py                     # 600 steps, 5 repetitions
    python benchmarks/spiky_overhead.py --steps 1000 --reps 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spiky_model import Data  # noqa: E402
from spiky_lm import train  # noqa: E402

CONFIGS = ("stable", "stable_observe", "stable_heal")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.003, help="the LR of all three runs")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    ns = argparse.Namespace(steps=args.steps, stable_lr=args.lr, lr=args.lr, b2=0.99, wd=0.1,
                            warmup=50, batch=32, measure_from=200)
    data = Data()
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for rep in range(args.reps):
        order = CONFIGS[rep % 3:] + CONFIGS[:rep % 3]
        for c in order:
            times[c].append(train(c, 0, ns, data)["wall_s"])
        print(f"rep {rep}: " + ", ".join(f"{c} {times[c][-1]:.2f}s" for c in CONFIGS),
              flush=True)
    ratios = {c: statistics.median(t / b for t, b in zip(times[c], times["stable"],
                                                            strict=True))
              for c in CONFIGS[1:]}
    for c, r in ratios.items():
        print(f"{c}: median {r:.3f}x plain (per-rep: " + ", ".join(
            f"{t / b:.3f}" for t, b in zip(times[c], times["stable"], strict=True)) + ")")
    print(json.dumps({"steps": args.steps, "reps": args.reps, "lr": args.lr, "times": times,
                      "median_ratio": ratios}))


if __name__ == "__main__":
    main()
