"""What fingerprinting a batch costs (`BatchProbe.observe` + `take`), by batch shape, in one run.

Per sample the guard keeps a 52-bit fingerprint of the raw bits and a row sum whose finiteness
says whether the sample holds a NaN / Inf. Two ways of computing the same thing are timed side by
side, interleaved, on the same tensors:

    before   the per-tensor product and int64 sum (a temporary the size of the batch) and a
             float64 row sum: what nanguard did up to issue 12's third pass
    now      `BatchProbe` as it is: one integer matrix-vector product per tensor on the CPU
             (no temporary) and a float32 row sum (float64 only for float64 data), read to
             a host list as the guard's one read does; a small CPU batch (256 samples at
             most) instead has one total sum per floating-point tensor read at once, and its
             per-tensor sums are left to the run store's writer thread

decoded into the step's statistics as the guard does on the training thread, timed
against the time of one forward pass of a small model on the same batch (so the cost reads as
a fraction of a training step). Reported: median ms per batch and the ratio before / now.

Usage:
    python benchmarks/batch_probe.py            # the run recorded in BENCHMARKS.md
    python benchmarks/batch_probe.py --quick    # a smoke test, not a measurement
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

try:
    import nanguard  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nanguard.watch.batch import BatchProbe
from nanguard.watch.fingerprint import _INT_VIEW, weights
from nanguard.watch.packet import Packet, host_values
from nanguard.watch.stats import StepStats

Batch = tuple[torch.Tensor, torch.Tensor]


def before(batch: Batch) -> torch.Tensor:
    """The earlier computation: per tensor a product (int32 or int64 temporary of the batch's
    size) summed in int64, combined, masked; float64 row sums."""
    h = None
    rows = []
    for t in batch:
        size = t.element_size()
        bits = t.contiguous().view(_INT_VIEW[size]).reshape(t.shape[0], -1)
        w = weights(bits.shape[1], bits.device, torch.int64 if size == 8 else torch.int32)
        f = (bits * w).sum(dim=1, dtype=torch.int64)
        h = f if h is None else torch.add(f, h, alpha=1000003)
        if t.is_floating_point():
            rows.append(t.reshape(t.shape[0], -1).sum(dim=1, dtype=torch.float64))
    assert h is not None
    return torch.cat([h & ((1 << 52) - 1), *rows]) if rows else h


def before_read(batch: Batch) -> list[float]:
    out: list[float] = before(batch).tolist()
    return out


_PROBE = BatchProbe()


def now(batch: Batch) -> StepStats:
    """The batch observed, taken, read and decoded as the guard does on the training thread."""
    probe = _PROBE
    probe.observe(batch)
    taken = probe.take()
    packet = Packet(torch.device("cpu"))
    taken.add_to(packet)
    stats = StepStats(step=0)
    BatchProbe.decode_taken(packet.read(host_values), taken, stats)
    return stats


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 rounds: a smoke test")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    shapes = {"tabular 128x128": (128, 128), "tokens 16x128 (int64)": (16, 128),
              "images 32x3x64x64": (32, 3, 64, 64), "images 128x3x224x224": (128, 3, 224, 224)}
    rounds = args.rounds
    if args.quick:
        shapes = {"tabular 8x4": (8, 4), "images 2x3x8x8": (2, 3, 8, 8)}
        rounds = 2
    g = torch.Generator().manual_seed(0)
    print(f"nanguard batch-probe benchmark: torch {torch.__version__}, 1 thread, {rounds} "
          "rounds, interleaved, medians")
    print(f"{'batch':26s} {'forward ms':>10s} {'before ms':>10s} {'now ms':>8s} "
          f"{'before/now':>10s}")
    result = {}
    for name, shape in shapes.items():
        if "int64" in name:
            x = torch.randint(0, 1024, shape, generator=g)
            model: nn.Module = nn.Sequential(nn.Embedding(1024, 64), nn.Linear(64, 64))
        else:
            x = torch.randn(*shape, generator=g)
            model = (nn.Sequential(nn.Conv2d(3, 16, 3, stride=2), nn.ReLU(), nn.Flatten(1))
                     if len(shape) == 4 else nn.Linear(shape[1], 64))
        y = torch.randint(0, 10, (shape[0],), generator=g)
        batch = (x, y)
        assert len(before(batch)) > 0 and now(batch).batch_tensors == 2  # warm-up
        times: dict[str, list[float]] = {"forward": [], "before": [], "now": []}
        with torch.no_grad():
            for _ in range(rounds):
                times["forward"].append(timed(partial(model, x)))
                times["before"].append(timed(partial(before_read, batch)))
                times["now"].append(timed(partial(now, batch)))
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        ratio = med["before"] / med["now"]
        print(f"{name:26s} {med['forward']:10.3f} {med['before']:10.3f} {med['now']:8.3f} "
              f"{ratio:9.1f}x")
        result[name] = {**{f"{k}_ms": round(v, 4) for k, v in med.items()},
                        "before_over_now": round(ratio, 2)}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
