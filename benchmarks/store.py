"""The run store's cost: what `write_step` costs the training thread, in all, and on disk.

Synthetic steps go through the real write path (`nanguard.record.rows.write_step` with a real
`StepStats` of float32 values and 32 per-sample batch fingerprints, into a real `RunStore`; the
RNG states every 100 steps as the guard writes them); no model is trained, so only the store is
measured.

Two modes:

    hot    for 2, 8 and 400 parameter tensors (with Adam's two state tensors each), `--steps`
           calls of write_step. Reported per call: CPU time on the calling thread
           (`time.thread_time`: what training pays), CPU time of the whole process from the first
           call until `close()` has written everything (`time.process_time`: the calling thread
           plus the background writer), wall time of the calls, and bytes of run.db + WAL per
           step after close (the size of an empty store subtracted).
    long   N steps of a small model (`--params`, default 2) with an alarm every `--alarm-every`
           steps: the store's size (run.db + WAL, while open and after close), the caller's
           and the process's CPU time per step. This is how large a store a run of N steps needs.

CPU-time columns are the ones to trust on a shared machine; print the load average with them.
Objects alive before a run are frozen out of the garbage collector (`gc.freeze`), so a full
collection over torch's objects does not land in one configuration's numbers.
The last line printed is one JSON object.

Usage:
    python benchmarks/store.py hot --steps 2000
    python benchmarks/store.py long --steps 100000
    python benchmarks/store.py long --steps 1000000
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from nanguard.detect.alarm import Alarm
from nanguard.record.rows import write_step
from nanguard.record.store import DB_NAME, RunStore
from nanguard.watch import rng
from nanguard.watch.stats import StepStats

RNG_EVERY = 100


def _pool(n_params: int, size: int, seed: int) -> list[StepStats]:
    """`size` steps' statistics of a model with `n_params` tensors and Adam state (float32
    values, as the probes produce them); reused round-robin with a new step number."""
    import struct

    rnd = random.Random(seed)

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    out = []
    for _ in range(size):
        out.append(StepStats(
            step=0, loss=f32(rnd.uniform(0.5, 2.0)), lr=1e-3,
            grad_norms={i: f32(rnd.uniform(1e-3, 1.0)) for i in range(n_params)},
            param_norms={i: f32(rnd.uniform(1.0, 10.0)) for i in range(n_params)},
            state_norms={"exp_avg": {i: f32(rnd.uniform(1e-4, 1e-1)) for i in range(n_params)},
                         "exp_avg_sq": {i: f32(rnd.uniform(1e-8, 1e-4))
                                        for i in range(n_params)}},
        ))
        out[-1].sample_hashes = [rnd.getrandbits(52) for _ in range(32)]  # (init=False)
        if hasattr(out[-1], "seal"):  # the guard seals a step once decoded (computed once)
            out[-1].seal()
    return out


def _size(folder: Path) -> int:
    return sum((folder / n).stat().st_size for n in (DB_NAME, f"{DB_NAME}-wal")
               if (folder / n).exists())


def _empty_size(root: Path) -> int:
    store = RunStore(root / "empty")
    store.close()
    return _size(root / "empty")


def _run(folder: Path, n_params: int, steps: int, alarm_every: int = 0,
         sample_every: int = 0) -> dict[str, Any]:
    pool = _pool(n_params, 64, seed=n_params)
    # The objects alive before (torch's modules, the previous run's) are moved out of the
    # garbage collector's view: a full collection over them would land in one run or another
    # (~30 us/step over 3000 steps) and say nothing about the store.
    gc.collect()
    gc.freeze()
    rng_state = rng.dumps(rng.capture())
    store = RunStore(folder)
    sizes: list[tuple[int, int]] = []
    t_thread, t_proc, t_wall = time.thread_time(), time.process_time(), time.perf_counter()
    for step in range(steps):
        stats = pool[step % len(pool)]
        stats.step = step
        stats.alarms = []
        if alarm_every and step % alarm_every == alarm_every // 2:
            stats.alarms = [Alarm(step=step, kind="spike", signal="grad_norm", value=50.0,
                                  message="synthetic spike")]
        write_step(store, stats, n_params, True)
        if step % RNG_EVERY == 0:  # as the guard does (RecordConfig.rng_every)
            store.write_rng(step, rng_state)
        if sample_every and step % sample_every == 0:
            sizes.append((step, _size(folder)))
    caller = time.thread_time() - t_thread
    wall = time.perf_counter() - t_wall
    open_size = _size(folder)
    store.close()
    total = time.process_time() - t_proc
    return {"caller_us": 1e6 * caller / steps, "total_us": 1e6 * total / steps,
            "wall_us": 1e6 * wall / steps, "open_bytes": open_size,
            "closed_bytes": _size(folder), "sizes": sizes}


def hot(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        empty = _empty_size(root)
        for n in args.params:
            r = _run(root / f"p{n}", n, args.steps)
            r["bytes_per_step"] = (r["closed_bytes"] - empty) / args.steps
            del r["sizes"]
            out[str(n)] = r
            print(f"{n:4d} tensors: caller {r['caller_us']:8.1f} us/step (thread CPU), "
                  f"total {r['total_us']:8.1f} us/step (process CPU), wall "
                  f"{r['wall_us']:8.1f} us/step, {r['bytes_per_step']:8.0f} B/step", flush=True)
    return out


def long(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        r = _run(folder, args.params[0], args.steps, alarm_every=args.alarm_every,
                 sample_every=max(1, args.steps // 10))
    peak = max([s for _, s in r["sizes"]] + [r["open_bytes"]])
    print(f"{args.steps} steps, {args.params[0]} tensors, an alarm every {args.alarm_every}: "
          f"caller {r['caller_us']:.1f} us/step, total {r['total_us']:.1f} us/step; store "
          f"{r['open_bytes'] / 1e6:.2f} MB open (peak {peak / 1e6:.2f} MB), "
          f"{r['closed_bytes'] / 1e6:.2f} MB closed", flush=True)
    for step, size in r["sizes"]:
        print(f"  step {step:>9d}: {size / 1e6:8.2f} MB")
    r["peak_bytes"] = peak
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("hot", "long"))
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--params", type=int, nargs="+", default=None)
    parser.add_argument("--alarm-every", type=int, default=250_000)
    args = parser.parse_args()
    if args.params is None:
        args.params = [2, 8, 400] if args.mode == "hot" else [2]
    result = (hot if args.mode == "hot" else long)(args)
    result.update(mode=args.mode, steps=args.steps, load=os.getloadavg()[0],
                  date=time.strftime("%Y-%m-%d %H:%M"))
    print(json.dumps(result, default=lambda x: None if isinstance(x, float)
                     and not math.isfinite(x) else x))


if __name__ == "__main__":
    main()
