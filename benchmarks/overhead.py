"""Step-time overhead of nanguard against plain training and its peers, measured in one run.

Five configurations train the same model from the same seed on the same batches:

    plain           forward, backward, optimizer.step, zero_grad
    default         + Guard(model, opt, out=<tmp>) and guard.watch(loss=..., batch=(x, y)) each
                    step: the default watch with the SQLite run store on, as users get it
    activations     default + activation abs-max / headroom on every step
    clip_grad_norm  + torch.nn.utils.clip_grad_norm_ after backward
    detect_anomaly  forward + backward inside torch.autograd.detect_anomaly()

on (a) a 4-layer causal transformer LM (d_model 256, 4 heads, seq 128, batch 16, vocab 1024,
AdamW) and (b) a small MLP (SGD with momentum).

Fairness: every configuration keeps its own model and optimizer (built from the same seed, so
guard hooks never touch another configuration's model), and the run is interleaved: each round
times ONE step of every configuration, in a shuffled order, so that load from other processes
and thermal drift hit all of them alike. The first rounds are discarded as warm-up; the figure
is the median step time over the remaining rounds, reported as a ratio to plain. "Added" time is
the median over rounds of (config - plain) in the same round. Beside wall time (perf_counter),
each step's process CPU time (process_time) is kept: other processes preempting this one do not
count in it, so on a loaded machine it is the steadier view (with more than one thread it also
counts worker threads spinning).

The last line printed is one JSON object (ratios to plain):

    {"lm": {"default": r, "activations": r, "clip_grad_norm": r, "detect_anomaly": r},
     "mlp": {...}, "machine": "...", "steps": N, ...}

Usage:
    python benchmarks/overhead.py                # the full run recorded in BENCHMARKS.md
    python benchmarks/overhead.py --steps 100 --threads 2
    python benchmarks/overhead.py --quick        # tiny models, a few steps: a smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
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

from nanguard import Guard, GuardConfig, RecordConfig

CONFIGS = ("plain", "default", "activations", "clip_grad_norm", "detect_anomaly")


# ----------------------------------------------------------------------------- workloads


class TinyLM(nn.Module):
    """A decoder-only transformer LM: token + position embeddings, causal pre-norm blocks."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        block = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(pos)
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    batches: list[tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str


def lm_workload(quick: bool, seed: int, device: torch.device) -> Workload:
    if quick:
        vocab, d, heads, layers, seq, batch = 64, 32, 2, 1, 16, 2
    else:
        vocab, d, heads, layers, seq, batch = 1024, 256, 4, 4, 128, 16

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = TinyLM(vocab, d, heads, layers, seq).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)

    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(8):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        batches.append((tokens[:, :-1].to(device), tokens[:, 1:].to(device)))

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return Workload("lm", build, batches, loss,
                    f"transformer LM: {layers} layers, d_model {d}, {heads} heads, seq {seq}, "
                    f"batch {batch}, vocab {vocab}, causal, AdamW")


def mlp_workload(quick: bool, seed: int, device: torch.device) -> Workload:
    if quick:
        inp, hidden, depth, classes, batch = 16, 32, 2, 4, 8
    else:
        inp, hidden, depth, classes, batch = 128, 512, 3, 10, 128

    def build() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        width = inp
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        model = nn.Sequential(*layers).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    g = torch.Generator().manual_seed(seed + 2)
    batches = [
        (torch.randn(batch, inp, generator=g).to(device),
         torch.randint(0, classes, (batch,), generator=g).to(device))
        for _ in range(8)
    ]
    return Workload("mlp", build, batches, nn.functional.cross_entropy,
                    f"MLP: {inp}-{'-'.join([str(hidden)] * depth)}-{classes}, ReLU, "
                    f"batch {batch}, SGD momentum 0.9")


# ----------------------------------------------------------------------------- configurations


@dataclass
class Runner:
    """One configuration: its own model, optimizer, optional guard, and a step function."""

    name: str
    step: Callable[[tuple[torch.Tensor, torch.Tensor]], None]
    guard: Guard | None
    times: list[float]
    """Wall-clock seconds per timed step (time.perf_counter)."""
    cpu: list[float]
    """CPU seconds of this process per timed step (time.process_time): insensitive to other
    processes preempting this one, so a steadier second view on a loaded machine."""


def make_runner(name: str, wl: Workload, out: Path) -> Runner:
    model, opt = wl.build()
    params = [p for p in model.parameters() if p.requires_grad]
    guard = None
    if name in ("default", "activations"):
        cfg = GuardConfig(record=RecordConfig(summary=False))
        guard = Guard(model, opt, out=out / name, config=cfg,
                      activations=True if name == "activations" else None)

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        if name == "detect_anomaly":
            with torch.autograd.detect_anomaly():
                loss = wl.loss(model(x), y)
                loss.backward()
        else:
            loss = wl.loss(model(x), y)
            if guard is not None:
                guard.watch(loss=loss, batch=(x, y))
            loss.backward()
            if name == "clip_grad_norm":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Runner(name, step, guard, [], [])


def run_workload(
    wl: Workload, steps: int, warmup: int, seed: int, device: torch.device, out: Path
) -> dict[str, Runner]:
    runners = {name: make_runner(name, wl, out) for name in CONFIGS}
    order = list(CONFIGS)
    shuffle = random.Random(seed)  # our own RNG: the global ones belong to the training
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        for r in range(warmup + steps):
            shuffle.shuffle(order)
            batch = wl.batches[r % len(wl.batches)]
            for name in order:
                runner = runners[name]
                sync()
                c0, t0 = time.process_time(), time.perf_counter()
                runner.step(batch)
                sync()
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                if r >= warmup:
                    runner.times.append(dt)
                    runner.cpu.append(dc)
    finally:
        for runner in runners.values():
            if runner.guard is not None:
                runner.guard.close()  # removes its hooks; writes report.json
    return runners


# ----------------------------------------------------------------------------- reporting


def machine(threads: int, device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    where = f"{cpu}, {os.cpu_count()} cores"
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} ({cpu})"
    return f"{where}, torch {torch.__version__}, {threads} threads"


def summarize(runners: dict[str, Runner]) -> dict[str, dict[str, float]]:
    plain = runners["plain"]
    base = statistics.median(plain.times)
    cpu_base = statistics.median(plain.cpu)
    out: dict[str, dict[str, float]] = {}
    for name, r in runners.items():
        med = statistics.median(r.times)
        q = statistics.quantiles(r.times, n=4) if len(r.times) > 1 else [med, med, med]
        cpu = statistics.median(r.cpu)
        out[name] = {
            "median": med, "p25": q[0], "p75": q[2], "ratio": med / base,
            "added": statistics.median(t - p for t, p in zip(r.times, plain.times, strict=True)),
            "cpu": cpu, "cpu_ratio": cpu / cpu_base if cpu_base > 0 else math.nan,
            "cpu_added": statistics.median(t - p for t, p in zip(r.cpu, plain.cpu, strict=True)),
        }
    return out


def vs_clip(s: dict[str, dict[str, float]], key: str) -> float | None:
    """nanguard default's added time over clip_grad_norm_'s; None if clipping is lost in noise."""
    clip = s["clip_grad_norm"][key]
    return round(s["default"][key] / clip, 3) if clip > 0 else None


def print_table(wl: Workload, s: dict[str, dict[str, float]], runners: dict[str, Runner]) -> None:
    print(f"\n{wl.name}: {wl.describe}")
    print(f"{'config':<16} {'median ms':>10} {'p25 ms':>9} {'p75 ms':>9} {'x plain':>8} "
          f"{'added ms':>9} {'cpu ms':>9} {'cpu x':>7} {'cpu added':>10}")
    for name in CONFIGS:
        v = s[name]
        print(f"{name:<16} {v['median'] * 1e3:>10.2f} {v['p25'] * 1e3:>9.2f} "
              f"{v['p75'] * 1e3:>9.2f} {v['ratio']:>8.3f} {v['added'] * 1e3:>+9.2f} "
              f"{v['cpu'] * 1e3:>9.2f} {v['cpu_ratio']:>7.3f} {v['cpu_added'] * 1e3:>+10.2f}")
    for label, key in (("wall", "added"), ("cpu", "cpu_added")):
        rel = vs_clip(s, key)
        verdict = f"{rel:.2f}x" if rel is not None else "n/a (clip_grad_norm_ lost in the noise)"
        print(f"default vs clip_grad_norm_ added {label} time: "
              f"{s['default'][key] * 1e3:+.2f} ms vs {s['clip_grad_norm'][key] * 1e3:+.2f} ms"
              f" = {verdict} (target <= 1.5x)")
    for name in ("default", "activations"):
        g = runners[name].guard
        if g is not None and g.report is not None:
            print(f"  {name} guard: {g.step} steps watched, status {g.report.status!r}, "
                  f"{len(g.alarms)} alarms, {g.host_reads} host reads")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="timed rounds per workload (each times one step of every config); "
                         "default 150, 5 with --quick")
    ap.add_argument("--warmup", type=int, default=None,
                    help="rounds discarded first (default 10, 2 with --quick)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads for the whole run (default 1: on a small, shared "
                         "machine one thread is the least disturbed by other processes)")
    ap.add_argument("--workloads", default="lm,mlp", help="comma-separated subset of lm,mlp")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true",
                    help="tiny models and a few steps: a smoke test, not a measurement")
    args = ap.parse_args(argv)
    steps = args.steps if args.steps is not None else (5 if args.quick else 150)
    warmup = args.warmup if args.warmup is not None else (2 if args.quick else 10)
    threads = args.threads
    torch.set_num_threads(threads)
    device = torch.device(args.device)
    # detect_anomaly warns on every entry; guard runs are healthy, nothing else to see here.
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")

    builders = {"lm": lm_workload, "mlp": mlp_workload}
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(wanted) - set(builders))
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from lm, mlp")

    where = machine(threads, device)
    print(f"nanguard {nanguard.__version__} overhead benchmark: {where}; "
          f"{steps} timed rounds + {warmup} warm-up, interleaved, medians")
    result: dict[str, object] = {}
    added_vs_clip: dict[str, float | None] = {}
    cpu: dict[str, dict[str, float | None]] = {}
    with tempfile.TemporaryDirectory(prefix="nanguard_bench_") as tmp:
        for name in wanted:
            wl = builders[name](args.quick, args.seed, device)
            runners = run_workload(wl, steps, warmup, args.seed, device, Path(tmp) / name)
            s = summarize(runners)
            print_table(wl, s, runners)
            result[name] = {c: round(s[c]["ratio"], 4) for c in CONFIGS if c != "plain"}
            cpu[name] = {c: round(s[c]["cpu_ratio"], 4) for c in CONFIGS if c != "plain"}
            cpu[name]["added_vs_clip"] = vs_clip(s, "cpu_added")
            added_vs_clip[name] = vs_clip(s, "added")
    result.update(machine=where, steps=steps, added_vs_clip=added_vs_clip, cpu=cpu)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
