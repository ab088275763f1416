"""Host-side (Python) cost of the default guard on small, fast steps, measured in one run.

On a small model the step itself is well under a millisecond and nanguard's fixed per-step
Python cost (decoding the host read, detectors, batch fingerprints, RNG capture, the run store)
is what decides whether "always on" is true. Three configurations train the same model from the
same seed on the same batches:

    plain           forward, backward, optimizer.step, zero_grad
    default         + Guard(model, opt, out=<tmp>) and guard.watch(loss=..., batch=(x, y)) each
                    step (the default watch, SQLite run store on, as users get it)
    clip_grad_norm  + torch.nn.utils.clip_grad_norm_ after backward (the yardstick of issue 12)

and ablations that say where the default's cost goes (not ways to run nanguard):

    no_batch        default, but guard.watch(loss=...) only: no batch fingerprints or NaN rows
    no_store        default with `out=""`: no run store (nothing queued, no writer thread)
    no_gate         default with the quiet gate off (`detect/gate.py`): every step through
                    all seven detectors, as before the gate (issue 26)
    state_every_step  default with `WatchConfig(sample_every=1)`: the optimizer state
                    measured every step, as before it was sampled (issue 39)
    norm_floor      no guard: only the norm passes the default watch makes (the gradients
                    before the update, the parameters after it every step; the optimizer
                    state on the steps it samples, every `sample_every`) and one host read of
                    them: the floor of the every-step watch set
    op_floor        no guard: every tensor op the default watch makes on a quiet step (the
                    norm passes, the loss, the batch's fingerprint sums and its total sums
                    read for finiteness, the RNG state) and the host read, in a few lines of
                    straight-line Python: what
                    the default costs with its bookkeeping (decoding, detectors, the record,
                    the hooks) taken away

on three workloads:

    logreg   textbook logistic regression: nn.Linear(20, 1), batch 64, BCE-with-logits, SGD
    mlp      the MLP of benchmarks/overhead.py: 128-512-512-512-10, ReLU, batch 128, SGD momentum
    blocks   ~400 small parameter tensors: 100 blocks of Linear(32, 32) + LayerNorm(32), batch 64,
             MSE, SGD

Every configuration has its own model and optimizer; each round times ONE step of each, in a
shuffled order (interleaved: load from other processes hits all of them alike); warm-up rounds
are discarded. Reported per workload: median ms per step, ms added over plain (median of the
paired per-round differences), ratio of medians, and the guard's added time over clip's, from
wall time (perf_counter) and process CPU time (process_time, steadier on a shared machine).

Targets (issue 12): logreg guard adds <= 0.1 ms/step; MLP default <= 1.10x plain; blocks: the
guard adds <= 1.5x what clip_grad_norm_ adds.

The last line printed is one JSON object.

Usage:
    python benchmarks/host_cost.py                 # the run recorded in BENCHMARKS.md
    python benchmarks/host_cost.py --steps 300 --workloads logreg
    python benchmarks/host_cost.py --quick         # a smoke test, not a measurement
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

try:
    import nanguard
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import nanguard

from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig, WatchConfig
from nanguard.watch.fingerprint import sample_sums

CONFIGS = ("plain", "default", "clip_grad_norm", "no_batch", "no_store", "no_gate",
           "state_every_step",
           "norm_floor", "op_floor")
Batch = tuple[torch.Tensor, torch.Tensor]
SAMPLE_EVERY = WatchConfig().sample_every
"""The default guard's stride for the sampled signals (`--sample-every` changes it)."""


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    batches: list[Batch]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def logreg(seed: int) -> Workload:
    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Linear(20, 1)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(64, 20, generator=g),
                torch.randint(0, 2, (64, 1), generator=g).float()) for _ in range(8)]
    return Workload("logreg", build, batches, nn.functional.binary_cross_entropy_with_logits,
                    "logistic regression: Linear(20, 1), batch 64, BCE-with-logits, SGD "
                    "(2 parameter tensors)")


def mlp(seed: int) -> Workload:
    inp, hidden, depth, classes, batch = 128, 512, 3, 10, 128

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = inp
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        model = nn.Sequential(*layers)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    g = torch.Generator().manual_seed(seed + 2)
    batches = [(torch.randn(batch, inp, generator=g),
                torch.randint(0, classes, (batch,), generator=g)) for _ in range(8)]
    return Workload("mlp", build, batches, nn.functional.cross_entropy,
                    "MLP of overhead.py: 128-512-512-512-10, ReLU, batch 128, SGD momentum 0.9 "
                    "(8 parameter tensors)")


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(torch.tanh(self.lin(x)))


def blocks(seed: int, n: int = 100) -> Workload:
    d = 32

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(*[Block(d) for _ in range(n)])
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(seed + 3)
    batches = [(torch.randn(64, d, generator=g), torch.randn(64, d, generator=g))
               for _ in range(8)]
    return Workload("blocks", build, batches, nn.functional.mse_loss,
                    f"{n} blocks of Linear({d}, {d}) + LayerNorm({d}), batch 64, MSE, SGD "
                    f"({4 * n} parameter tensors)")


@dataclass
class Runner:
    name: str
    step: Callable[[Batch], None]
    guard: Guard | None
    times: list[float]
    cpu: list[float]


def make_runner(name: str, wl: Workload, out: Path) -> Runner:
    model, opt = wl.build()
    params = [p for p in model.parameters() if p.requires_grad]
    guard = None
    if name in ("default", "no_batch", "no_store", "no_gate", "state_every_step"):
        watch = WatchConfig(sample_every=1 if name == "state_every_step" else SAMPLE_EVERY)
        guard = Guard(model, opt, out="" if name == "no_store" else out / name,
                      config=GuardConfig(record=RecordConfig(summary=False), watch=watch,
                                         detect=DetectConfig(quiet_gate=name != "no_gate")))
    count = [0]

    def step(batch: Batch) -> None:
        x, y = batch
        loss = wl.loss(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=None if name == "no_batch" else (x, y))
        loss.backward()
        if name == "clip_grad_norm":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        if name == "op_floor":
            kept = _batch_ops(x, y)
            torch.get_rng_state()  # the step's RNG state, kept for a replay
        if name in ("norm_floor", "op_floor"):
            pre = torch._foreach_norm([p.grad for p in params], 2, dtype=torch.float32)
        opt.step()
        if name in ("norm_floor", "op_floor"):
            state = [v for p in params for k, v in opt.state[p].items()
                     if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape
                     ] if count[0] % SAMPLE_EVERY == 0 else []
            count[0] += 1
            post = torch._foreach_norm(params + state, 2, dtype=torch.float32)
        if name == "norm_floor":
            torch.stack([*pre, *post]).tolist()
        if name == "op_floor":
            # Read as the guard reads on the CPU: each 0-dim value (the batch's sums are read
            # by the writer thread, off the step).
            [t.item() for t in (loss.detach(), *pre, *post)]
            del kept
        opt.zero_grad(set_to_none=True)

    return Runner(name, step, guard, [], [])


def _batch_ops(x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], list[float]]:
    """The tensor ops `BatchProbe.observe` makes on the training thread for a small CPU batch
    (x, y): each tensor's fingerprint sums (the run store's writer thread reads them, not the
    step) and one total sum per floating-point tensor, read at once. Returns both."""
    sums, totals = [], []
    for t in (x, y):
        sums.append(sample_sums(t))
        if t.is_floating_point():
            totals.append(t.sum(dtype=torch.float32).item())
    return sums, totals


def run(wl: Workload, steps: int, warmup: int, seed: int, out: Path) -> dict[str, Runner]:
    runners = {name: make_runner(name, wl, out) for name in CONFIGS}
    order = list(CONFIGS)
    shuffle = random.Random(seed)  # our own RNG: the global ones belong to the training
    try:
        for r in range(warmup + steps):
            shuffle.shuffle(order)
            batch = wl.batches[r % len(wl.batches)]
            for name in order:
                runner = runners[name]
                c0, t0 = time.process_time(), time.perf_counter()
                runner.step(batch)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r >= warmup:
                    runner.times.append(dt)
                    runner.cpu.append(dc)
    finally:
        for runner in runners.values():
            if runner.guard is not None:
                runner.guard.close()
    return runners


def summarize(runners: dict[str, Runner]) -> dict[str, dict[str, float]]:
    plain = runners["plain"]
    out: dict[str, dict[str, float]] = {}
    for name, r in runners.items():
        out[name] = {
            "median": statistics.median(r.times),
            "ratio": statistics.median(r.times) / statistics.median(plain.times),
            "added": statistics.median(a - b for a, b in zip(r.times, plain.times, strict=True)),
            "cpu": statistics.median(r.cpu),
            "cpu_added": statistics.median(a - b for a, b in zip(r.cpu, plain.cpu, strict=True)),
        }
    return out


def store_bytes(runner: Runner) -> float | None:
    """Bytes the run store holds per watched step (run.db and its WAL, after close)."""
    g = runner.guard
    folder = g.folder if g is not None else None
    if g is None or folder is None or not g.step:
        return None
    total = sum(f.stat().st_size for f in Path(folder).glob("run.db*"))
    return total / g.step


def main(argv: list[str] | None = None) -> int:
    global SAMPLE_EVERY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="timed rounds (default 300)")
    ap.add_argument("--warmup", type=int, default=None, help="discarded rounds (default 20)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workloads", default="logreg,mlp,blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a few steps: a smoke test")
    ap.add_argument("--sample-every", type=int, default=None,
                    help="WatchConfig.sample_every of the default guard and the floors "
                         f"(default {SAMPLE_EVERY})")
    args = ap.parse_args(argv)
    if args.sample_every is not None:
        if args.sample_every < 1:
            ap.error("--sample-every must be >= 1")
        SAMPLE_EVERY = args.sample_every
    steps = args.steps if args.steps is not None else (5 if args.quick else 300)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 20)
    torch.set_num_threads(args.threads)
    builders = {"logreg": logreg, "mlp": mlp, "blocks": blocks}
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(builders))
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(builders)}")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan
    print(f"nanguard {nanguard.__version__} host-cost benchmark: {os.cpu_count()} cores, torch "
          f"{torch.__version__}, {args.threads} threads; {steps} timed rounds + {warmup} warm-up, "
          f"interleaved, medians; load average {load:.2f} at the start")
    result: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="nanguard_host_") as tmp:
        for name in wanted:
            wl = builders[name](args.seed)
            runners = run(wl, steps, warmup, args.seed, Path(tmp) / name)
            s = summarize(runners)
            print(f"\n{wl.name}: {wl.describe}")
            print(f"{'config':<16} {'median ms':>10} {'x plain':>8} {'added ms':>9} "
                  f"{'cpu ms':>8} {'cpu added':>10}")
            for c in CONFIGS:
                v = s[c]
                print(f"{c:<16} {v['median'] * 1e3:>10.3f} {v['ratio']:>8.3f} "
                      f"{v['added'] * 1e3:>+9.3f} {v['cpu'] * 1e3:>8.3f} "
                      f"{v['cpu_added'] * 1e3:>+10.3f}")
            row: dict[str, float | None] = {
                "plain_ms": round(s["plain"]["median"] * 1e3, 4),
                "default_x": round(s["default"]["ratio"], 4),
                "default_added_ms": round(s["default"]["added"] * 1e3, 4),
                "default_cpu_added_ms": round(s["default"]["cpu_added"] * 1e3, 4),
                "clip_added_ms": round(s["clip_grad_norm"]["added"] * 1e3, 4),
                "clip_cpu_added_ms": round(s["clip_grad_norm"]["cpu_added"] * 1e3, 4),
                "no_batch_added_ms": round(s["no_batch"]["added"] * 1e3, 4),
                "no_store_added_ms": round(s["no_store"]["added"] * 1e3, 4),
                "no_gate_added_ms": round(s["no_gate"]["added"] * 1e3, 4),
                "no_gate_cpu_added_ms": round(s["no_gate"]["cpu_added"] * 1e3, 4),
                "state_every_step_added_ms": round(s["state_every_step"]["added"] * 1e3, 4),
                "norm_floor_added_ms": round(s["norm_floor"]["added"] * 1e3, 4),
                "op_floor_added_ms": round(s["op_floor"]["added"] * 1e3, 4),
            }
            for label, key in (("wall", "added"), ("cpu", "cpu_added")):
                clip = s["clip_grad_norm"][key]
                rel = s["default"][key] / clip if clip > 0 else None
                row[f"vs_clip_{label}"] = None if rel is None else round(rel, 3)
                print(f"default vs clip_grad_norm_ added {label} time: "
                      f"{s['default'][key] * 1e3:+.3f} ms vs {clip * 1e3:+.3f} ms = "
                      + (f"{rel:.2f}x" if rel is not None else "n/a"))
            per_step = store_bytes(runners["default"])
            row["store_bytes_per_step"] = None if per_step is None else round(per_step)
            if per_step is not None:
                print(f"  run store: {per_step:.0f} bytes per step (run.db + WAL)")
            result[name] = row
    result["steps"] = steps
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
