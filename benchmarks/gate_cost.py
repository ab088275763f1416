"""The detector stage of a quiet step, with and without the quiet gate (`detect/gate.py`).

`host_cost.py` times whole steps, where the detectors are a small part and the gate's effect
sits inside the noise of a shared machine. This times the stage alone: a seeded healthy series
of 3000 steps (noisy grad norm, slowly falling loss, momentum and activation maxima, two
parameters), each step's `StepStats` sealed as the guard seals it and its global norms already
computed (they are shared with the record), then either every default detector's `check` (the
full pass) or the gate (each detector's quiet lane, its `check` where the lane cannot stand
in). Rounds alternate the two in a shuffled order on fresh detectors; reported: median
microseconds per step and the share of steps the gate took.

Usage:
    python benchmarks/gate_cost.py              # the run recorded in BENCHMARKS.md
    python benchmarks/gate_cost.py --rounds 3
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

try:
    import nanguard  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from nanguard.config import DetectConfig
from nanguard.detect import default_detectors
from nanguard.detect.gate import QuietGate
from nanguard.watch.stats import StepStats


def series(n: int, seed: int = 0) -> list[StepStats]:
    r = random.Random(seed)
    g, loss, act, mom = 1.0, 2.0, 5.0, 0.5
    out = []
    for step in range(n):
        g *= math.exp(r.gauss(0, 0.05))
        loss *= math.exp(r.gauss(-0.0005, 0.02))
        act *= math.exp(r.gauss(0, 0.02))
        mom *= math.exp(r.gauss(0, 0.02))
        st = StepStats(step=step, lr=0.1, loss=loss, grad_norms={0: g, 1: g / 3},
                       param_norms={0: 3.0, 1: 1.0}, activations={"m": act},
                       state_norms={"momentum_buffer": {0: mom, 1: mom / 2}})
        st.seal()
        _ = st.grad_norm, st.param_norm, st.momentum_norm  # shared with the record: computed
        out.append(st)
    return out


def one(rows: list[StepStats], gated: bool) -> tuple[float, int]:
    dets = default_detectors(DetectConfig())
    gate = QuietGate(dets)
    t0 = time.perf_counter()
    for st in rows:
        if gated:
            gate.run(st, "both", [])  # sealed by `series`, nothing non-finite
            continue
        for d in dets:
            d.check(st)
    return (time.perf_counter() - t0) / len(rows), gate.passed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args(argv)
    rows = series(args.steps)
    times: dict[str, list[float]] = {"full": [], "gated": []}
    passed = 0
    shuffle = random.Random(0)
    for _ in range(args.rounds):
        order = ["full", "gated"]
        shuffle.shuffle(order)
        for name in order:
            dt, p = one(rows, name == "gated")
            times[name].append(dt)
            passed = max(passed, p)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"detector stage, {args.steps} healthy steps x {args.rounds} rounds (median):")
    print(f"  full pass  {med['full']:6.2f} us/step")
    print(f"  gated      {med['gated']:6.2f} us/step   gate took {passed}/{args.steps} steps")
    print(json.dumps({"full_us": round(med["full"], 2), "gated_us": round(med["gated"], 2),
                      "gate_share": round(passed / args.steps, 4), "steps": args.steps,
                      "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
