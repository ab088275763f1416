"""What a run that stays non-finite costs under `observe` (issue 10: "a run with a NaN in every
step costs 7x plain; bound the extra work").

Once a value is non-finite, `observe` lets training go on, and every later step is non-finite
too. Such a step must not cost much more than a quiet one: it used to commit to the run store
at every step. Three configurations train the same small MLP (32-64-1, SGD, batch 64) on the
same batch, one step each per round, in a shuffled order (interleaved: load from other
processes hits all of them alike), warm-up rounds discarded:

    plain    no nanguard
    quiet    Guard(model, opt, out=<tmp>) + watch(loss=, batch=) on a clean batch
    nan      the same on a batch with one NaN element (every step non-finite from step 0)

Reported: CPU ms per step (process_time, steadier on a shared machine; it counts the run
store's writer thread too), median and mean, and the added ms over plain of `quiet` and `nan`
(median of paired per-round differences, and difference of means). The last line printed is
one JSON object.

Usage:
    python benchmarks/nan_steps.py [--steps 400]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

try:
    import nanguard  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nanguard import Guard, GuardConfig, RecordConfig


def _setup(nan: bool | None, folder: str):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randn(64, 1)
    if nan:
        x[3, 0] = float("nan")
    guard = None if nan is None else Guard(
        model, opt, out=folder, config=GuardConfig(record=RecordConfig(summary=False)))

    def step() -> float:
        t = time.process_time()
        loss = nn.functional.mse_loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return (time.process_time() - t) * 1e3

    return step, guard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    a = p.parse_args()
    torch.set_num_threads(1)
    tmp = tempfile.mkdtemp()
    configs = {"plain": None, "quiet": False, "nan": True}
    steps = {k: _setup(v, f"{tmp}/{k}") for k, v in configs.items()}
    times: dict[str, list[float]] = {k: [] for k in configs}
    order = list(configs)
    for r in range(a.warmup + a.steps):
        random.shuffle(order)
        for k in order:
            ms = steps[k][0]()
            if r >= a.warmup:
                times[k].append(ms)
    for _, guard in steps.values():
        if guard is not None:
            guard.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    added = {k: statistics.median([b - p for b, p in zip(times[k], times["plain"], strict=True)])
             for k in ("quiet", "nan")}
    # The mean counts what comes in bursts (a commit every N steps, the writer thread's work
    # landing in some steps' process time) that a median leaves out.
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    for k in configs:
        extra = (f", +{added[k]:.3f} ms over plain (median), +{mean[k] - mean['plain']:.3f} ms "
                 "(mean)" if k in added else "")
        print(f"{k:6s} {med[k]:.3f} ms/step (cpu, median), {mean[k]:.3f} (mean){extra}")
    print(json.dumps({"median_ms": med, "mean_ms": mean, "added_ms": added, "steps": a.steps}))


if __name__ == "__main__":
    main()
