"""Cost of the `rollback` policy: snapshot time as a share of step time, and peak memory.

(1) Snapshot cost. `HostSnapshot.capture` (the host copy of parameters, buffers and optimizer
state the `rollback` policy refreshes every K steps, K = RecoverConfig().snapshot_every) against
plain training, on the same models as benchmarks/overhead.py (its builders are imported): (a) the
4-layer causal transformer LM (d_model 256, seq 128, batch 16, vocab 1024, AdamW) and (b) the
MLP (SGD with momentum). One run, interleaved: each round times one plain training step, then
one capture of the same model and optimizer; after warm-up rounds, the figure is

    median(capture time) / (K * median(step time))        target: <= 5%

(2) Peak memory. Separate subprocesses train N steps (N > K, so the snapshot is refreshed at
least once) of plain training, of training under the default `observe` guard and under the
`rollback` guard; each reports its own peak resident set size (VmHWM from /proc/self/status;
resource.getrusage ru_maxrss where that is missing: on Linux ru_maxrss survives fork + exec, so
a child would report its parent's peak). The model and batches are in all three. The excess
of rollback over plain is compared with one copy of the model and optimizer state (the
snapshot's bytes):

    (peak_rollback - peak_plain) / copy_bytes                 target: <= 1.0 (+ watch cost)

and the excess over `observe` isolates what recovery adds to the watch.

(3) Healing, the measure of success (DESIGN.md section 5, "recover"): the LR/momentum cascade
scenario (`nanguard.scenarios.cascade`), seeds 0..S-1, fixed length (300 steps, no early stop).
Plain runs give the failing seeds and the final losses (mean of the last 20 steps) of the seeds
that never failed; each failing seed is then trained under `rollback` and under `skip` with
`RecoverConfig(skip_escalation="rollback")` (default settings otherwise). Per seed: the final
loss, whether it lies within [min, max] of the never-failing seeds, the actions, updates
rolled back, LR factor, snapshot memory, and CPU time (process_time) against the plain run.

The last line printed is one JSON object:

    {"snapshot": {"lm": {"step_ms", "capture_ms", "k", "share"}, "mlp": {...}},
     "memory": {"lm": {"plain_mb", "observe_mb", "rollback_mb", "copy_mb", "excess_copies",
                       "excess_over_observe_copies"}, "mlp": {...}},
     "cascade": {"healthy_range", "seeds": {seed: {"rollback": {...}, "skip": {...}}}, ...},
     "machine": "...", ...}

Usage:
    python benchmarks/recover.py                  # the full run recorded in BENCHMARKS.md
    python benchmarks/recover.py --quick          # tiny models, a few steps: a smoke test
    python benchmarks/recover.py --parts cascade  # only the healing figures (~1 min)
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nanguard import Guard, GuardConfig, RecordConfig  # noqa: E402
from nanguard.config import RecoverConfig  # noqa: E402
from nanguard.recover import HostSnapshot  # noqa: E402
from nanguard.scenarios.cascade import train_cascade  # noqa: E402
from overhead import Workload, lm_workload, machine, mlp_workload  # noqa: E402

WORKLOADS = {"lm": lm_workload, "mlp": mlp_workload}


def _train_step(wl: Workload, model, opt, batch, guard=None) -> None:
    x, y = batch
    loss = wl.loss(model(x), y)
    if guard is not None:
        guard.watch(loss=loss, batch=(x, y))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot_cost(wl: Workload, rounds: int, warmup: int) -> dict[str, float]:
    model, opt = wl.build()
    snap = HostSnapshot(model, opt)
    k = RecoverConfig().snapshot_every
    steps, captures = [], []
    for r in range(warmup + rounds):
        batch = wl.batches[r % len(wl.batches)]
        t0 = time.perf_counter()
        _train_step(wl, model, opt, batch)
        t1 = time.perf_counter()
        snap.capture(r + 1)
        t2 = time.perf_counter()
        if r >= warmup:
            steps.append(t1 - t0)
            captures.append(t2 - t1)
    step, cap = statistics.median(steps), statistics.median(captures)
    return {
        "step_ms": round(step * 1e3, 3),
        "capture_ms": round(cap * 1e3, 3),
        "k": k,
        "share": round(cap / (k * step), 5),
        "copy_mb": round(snap.nbytes / 2**20, 2),
    }


def _peak_kb() -> int:
    """This process's peak RSS in KiB. Linux carries ru_maxrss over fork + exec (a child starts
    at its parent's peak), so the mm's own high-water mark, VmHWM, is read where it exists."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child(workload: str, mode: str, steps: int, quick: bool) -> None:
    """One memory run: print {"peak_kb", "copy_bytes"} as JSON."""
    torch.set_num_threads(1)
    wl = WORKLOADS[workload](quick, 0, torch.device("cpu"))
    model, opt = wl.build()
    guard = None
    if mode != "plain":
        cfg = GuardConfig(policy=mode, record=RecordConfig(out="", summary=False))
        guard = Guard(model, opt, config=cfg)
    for r in range(steps):
        _train_step(wl, model, opt, wl.batches[r % len(wl.batches)], guard)
    copy = HostSnapshot(model, opt)
    copy.capture(steps)  # only to count the bytes of one copy (after the peak is read)
    peak = _peak_kb()
    if guard is not None:
        guard.close()
    print(json.dumps({"peak_kb": peak, "copy_bytes": copy.nbytes}))


def memory(workload: str, steps: int, quick: bool, repeat: int) -> dict[str, float]:
    """Peak RSS of each mode: the median of `repeat` runs, the modes interleaved."""
    peaks: dict[str, list[float]] = {m: [] for m in ("plain", "observe", "rollback")}
    copy_bytes = 0
    for _ in range(repeat):
        for mode in peaks:
            cmd = [sys.executable, __file__, "--child", workload, mode, "--steps", str(steps)]
            if quick:
                cmd.append("--quick")
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            peaks[mode].append(got["peak_kb"] / 1024)
            copy_bytes = got["copy_bytes"]
    out = {f"{m}_mb": round(statistics.median(v), 1) for m, v in peaks.items()}
    copy_mb = copy_bytes / 2**20
    out["copy_mb"] = round(copy_mb, 2)
    out["excess_mb"] = round(out["rollback_mb"] - out["plain_mb"], 1)
    out["excess_copies"] = round((out["rollback_mb"] - out["plain_mb"]) / copy_mb, 3)
    out["excess_over_observe_copies"] = round((out["rollback_mb"] - out["observe_mb"]) / copy_mb, 3)
    return out


def _tail(losses: list[float], n: int = 20) -> float:
    return sum(losses[-n:]) / n


def _guarded(seed: int, steps: int, policy: str) -> dict:
    guards: list[Guard] = []

    def factory(model, optimizer):
        cfg = GuardConfig(policy=policy, record=RecordConfig(out="", summary=False),
                          recover=RecoverConfig(skip_escalation="rollback"))
        guards.append(Guard(model, optimizer, config=cfg))
        return guards[0]

    t0 = time.process_time()
    _, losses = train_cascade(seed, factory, steps=steps)
    cpu = time.process_time() - t0
    report = guards[0].report
    cost = report.run.get("recovery") or {}
    kinds = [a["action"] for a in report.actions]
    return {"final": round(_tail(losses), 5), "status": report.status,
            "skips": kinds.count("skip"), "rollbacks": kinds.count("rollback"),
            "gave_up": "give_up" in kinds,
            "updates_rolled_back": cost.get("updates_rolled_back"),
            "lr_factor": cost.get("lr_factor"), "snapshot_bytes": cost.get("snapshot_bytes"),
            "cpu_s": round(cpu, 3)}


def cascade(seeds: int, steps: int) -> dict:
    """Healing on the cascade: failing seeds under rollback / skip vs the never-failing range."""
    plain: dict[int, tuple[float, float, bool]] = {}
    train_cascade(0, None, steps=20)  # warm-up: the first run pays torch's lazy start-up
    for seed in range(seeds):
        t0 = time.process_time()
        _, losses = train_cascade(seed, None, steps=steps)
        plain[seed] = (_tail(losses), time.process_time() - t0,
                       all(math.isfinite(v) for v in losses))
    healthy = [f for f, _, ok in plain.values() if ok]
    low, high = min(healthy), max(healthy)
    out: dict = {"seeds": {}, "healthy_range": [round(low, 5), round(high, 5)],
                 "healthy_median": round(statistics.median(healthy), 5),
                 "n_healthy": len(healthy), "steps": steps}
    for seed, (_, cpu, ok) in plain.items():
        if ok:
            continue
        # The same seed with no outlier sample at all: the model it would have been.
        clean = _tail(train_cascade(seed, None, steps=steps, outlier_p=0.0)[1])
        row = {"plain_cpu_s": round(cpu, 3), "clean_final": round(clean, 5)}
        for policy in ("rollback", "skip"):
            r = _guarded(seed, steps, policy)
            r["healed"] = low <= r["final"] <= high
            r["vs_clean"] = round(r["final"] / clean, 3)
            row[policy] = r
        out["seeds"][seed] = row
    out["healed"] = {p: sum(r[p]["healed"] for r in out["seeds"].values())
                     for p in ("rollback", "skip")}
    out["failing"] = len(out["seeds"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 30)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 5)")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps of each memory run (default 2 K + 10)"
    )
    ap.add_argument("--workloads", default="lm,mlp")
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="memory runs per mode; the median is reported (allocator noise)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny models, few steps (smoke test)")
    ap.add_argument("--parts", default="snapshot,cascade",
                    help="comma list of: snapshot (cost and memory), cascade (healing)")
    ap.add_argument("--seeds", type=int, default=None,
                    help="cascade seeds (default 30; 10 with --quick)")
    ap.add_argument("--child", nargs=2, metavar=("WORKLOAD", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    k = RecoverConfig().snapshot_every
    steps = args.steps or (2 * k + 10 if not args.quick else k + 2)
    if args.child:
        child(args.child[0], args.child[1], steps, args.quick)
        return 0
    torch.set_num_threads(1)
    rounds = args.rounds or (4 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    result: dict = {"snapshot": {}, "memory": {}}
    parts = set(args.parts.split(","))
    if not parts <= {"snapshot", "cascade"}:
        ap.error(f"unknown --parts {args.parts!r}; use snapshot, cascade")
    for name in args.workloads.split(",") if "snapshot" in parts else []:
        wl = WORKLOADS[name](args.quick, 0, torch.device("cpu"))
        s = snapshot_cost(wl, rounds, warmup)
        result["snapshot"][name] = s
        print(f"{name}: {wl.describe}")
        print(
            f"  step {s['step_ms']:.2f} ms, capture {s['capture_ms']:.3f} ms "
            f"({s['copy_mb']} MB), K={k}: {100 * s['share']:.2f}% of K steps"
        )
        m = memory(name, steps, args.quick, args.repeat)
        result["memory"][name] = m
        print(
            f"  peak RSS over {steps} steps: plain {m['plain_mb']} MB, observe "
            f"{m['observe_mb']} MB, rollback {m['rollback_mb']} MB; one copy "
            f"{m['copy_mb']} MB: excess {m['excess_copies']} copies "
            f"({m['excess_over_observe_copies']} over observe)"
        )
    if "cascade" in parts:
        c = cascade(args.seeds or (10 if args.quick else 30), 300)
        result["cascade"] = c
        lo, hi = c["healthy_range"]
        print(f"cascade: {c['failing']} failing seeds; final loss of the {c['n_healthy']} "
              f"never-failing ones in [{lo}, {hi}] (median {c['healthy_median']})")
        for seed, row in c["seeds"].items():
            print(f"  seed {seed}: " + "; ".join(
                f"{p} {row[p]['final']:.4g} ({'healed' if row[p]['healed'] else 'NOT healed'}, "
                f"{row[p]['vs_clean']:.2f}x the outlier-free run, "
                f"{row[p]['skips']} skip, {row[p]['rollbacks']} rollback, "
                f"cpu {row[p]['cpu_s'] / row['plain_cpu_s']:.2f}x plain)"
                for p in ("rollback", "skip")))
        print(f"  healed: rollback {c['healed']['rollback']}/{c['failing']}, "
              f"skip {c['healed']['skip']}/{c['failing']}")
    result.update(
        machine=machine(1, torch.device("cpu")),
        k=k,
        rounds=rounds,
        warmup=warmup,
        memory_steps=steps,
        repeat=args.repeat,
        quick=args.quick,
        command=" ".join(["python"] + sys.argv),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
