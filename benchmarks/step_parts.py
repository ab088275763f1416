"""Where the default guard's quiet step spends its time, part by part, on host_cost.py's
workloads: the numbers behind issue 39's verdict that the MLP's ratio is set by cold caches,
not by what the guard computes.

The default guard (as `host_cost.py` builds it) trains beside `clip_grad_norm_` (interleaved,
one step each per round, warm-up discarded); each of the guard's parts is timed inside the
step with `perf_counter` around it (a wrapper: ~0.2 us each, paid alike by every part):

    observe        `BatchProbe.observe`, inside `watch`: the batch's fingerprints and its
                   finiteness totals (tensor ops on the batch, right after the forward)
    grad_pass      `QuietLane.begin`, inside the optimizer pre-hook: the gradients' norms
    param_pass     `QuietLane.read`, inside the post-hook: the parameters' norms after the
                   update, the host read, its decoding
    judge          `Judge.after_update`, inside the post-hook: the quiet gate's detectors,
                   the record's row, the history (Python only, no tensor op)
    watch, pre_hook, post_hook   the three entry points whole (each includes the parts above)

and `clip_grad_norm_`'s call (`clip_call`, in a clipping model trained beside it). Reported:
the median of each part in microseconds, and each as a share of clip's call. Two things these
show that `host_cost.py`'s end-to-end differences do not: on the MLP the same Python of `judge`
takes ~2.5x its time on the logistic regression (the step's heavy kernels have evicted its
code and data, as `cold_ops.py` shows for single ops); and clip's call costs more inside the
step than clip adds to it end to end (its in-place pass leaves the gradients in the caches for
the optimizer's update), where the guard's parts add about what they cost.

The last line printed is one JSON object.

Usage:
    python benchmarks/step_parts.py                # both workloads, 600 rounds
    python benchmarks/step_parts.py --quick        # a smoke test, not a measurement
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import host_cost  # noqa: E402
from nanguard.step.judging import Judge  # noqa: E402
from nanguard.step.pipeline import StepPipeline  # noqa: E402
from nanguard.watch.batch import BatchProbe  # noqa: E402
from nanguard.watch.lane import QuietLane  # noqa: E402

PARTS: dict[str, tuple[type, str]] = {
    "observe": (BatchProbe, "observe"),
    "grad_pass": (QuietLane, "begin"),
    "param_pass": (QuietLane, "read"),
    "judge": (Judge, "after_update"),
    "watch": (StepPipeline, "watch"),
    "pre_hook": (StepPipeline, "pre_hook"),
    "post_hook": (StepPipeline, "post_hook"),
}


def _timed(times: dict[str, list[float]]) -> Callable[[], None]:
    """Wrap each part with a timer appending to `times`; returns the undo."""
    originals = []
    for name, (cls, attr) in PARTS.items():
        fn = getattr(cls, attr)
        originals.append((cls, attr, fn))

        def wrapper(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                times[_name].append(time.perf_counter() - t0)

        setattr(cls, attr, wrapper)

    def undo() -> None:
        for cls, attr, fn in originals:
            setattr(cls, attr, fn)

    return undo


def measure(workload: str, rounds: int, warmup: int) -> dict[str, float]:
    """Median microseconds of each part (and of clip's call) on `workload`."""
    wl = getattr(host_cost, workload)(0)
    times: dict[str, list[float]] = defaultdict(list)
    undo = _timed(times)  # before the guard is built: its hooks are bound methods
    with tempfile.TemporaryDirectory(prefix="nanguard_parts_") as tmp:
        guarded = host_cost.make_runner("default", wl, Path(tmp))
        model, opt = wl.build()
        params = [p for p in model.parameters() if p.requires_grad]
        clip: list[float] = []
        try:
            for r in range(warmup + rounds):
                x, y = wl.batches[r % len(wl.batches)]
                guarded.step((x, y))
                loss = wl.loss(model(x), y)
                loss.backward()
                t0 = time.perf_counter()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                clip.append(time.perf_counter() - t0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        finally:
            undo()
            assert guarded.guard is not None
            guarded.guard.close()
    kept = {k: v[warmup:] for k, v in times.items()}
    out = {k: round(statistics.median(v) * 1e6, 1) for k, v in kept.items() if v}
    out["clip_call"] = round(statistics.median(clip[warmup:]) * 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--workloads", default="logreg,mlp")
    ap.add_argument("--quick", action="store_true", help="a few rounds: a smoke test")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rounds, warmup = (5, 2) if args.quick else (args.rounds, args.warmup)
    result: dict[str, Any] = {}
    for name in args.workloads.split(","):
        parts = measure(name, rounds, warmup)
        clip = parts["clip_call"]
        print(f"\n{name}: median us per step (x clip_grad_norm_'s call, {clip:.1f} us)")
        for k, v in parts.items():
            print(f"  {k:<11} {v:>8.1f}  {v / clip if clip else float('nan'):>5.2f}x")
        result[name] = parts
    result["rounds"] = rounds
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
