"""What one replica check costs (nanguard.watch.replicas): the fingerprint of the parameters
against `torch.linalg.vector_norm` over the same tensors (what `clip_grad_norm_` computes),
alternated in one run, and the whole check (`compare`: fingerprint + all_gather) in a 2-process
gloo group on this machine.

`--lm`: the cost side by side in training, on the project's LM benchmark setting
(benchmarks/overhead.py's transformer LM: 4 layers, d_model 256, seq 128, batch 16, AdamW) in
DDP on 2 gloo processes under `policy='skip'` (every step's decision agreed across ranks):
plain DDP, the guard without the check (`replica_every=0`), with a check every step riding the
agreement (`ride`), and the same with its own all_gather (`separate`). Each configuration has
its own model; every round steps each once, in a seeded shuffled order (the same on both
ranks). `per check` is the median over rounds of (config - no check) in the same round; at the
default interval (100) a step pays a hundredth of it.

Usage: python benchmarks/replicas.py [--rounds 20] [--lm [--quick]]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanguard.runtime import distributed
from nanguard.watch import replicas

SETS = {
    "400 small tensors (64x64)": [(64, 64)] * 400,
    # benchmarks/overhead.py's LM (4 layers, d_model 256, vocab 1024, seq 128): its shapes
    "LM benchmark (3.7M params)": [(1024, 256), (128, 256)] + [
        (768, 256), (768,), (256, 256), (256,), (1024, 256), (1024,), (256, 1024), (256,),
        (256,), (256,), (256,), (256,)] * 4 + [(256,), (256,), (1024, 256), (1024,)],
    "25M params (25 x 1000x1000)": [(1000, 1000)] * 25,
}


def _median_ms(fn, *args, rounds: int = 1) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    return replicas.combine(replicas.tensor_fingerprints(params))


def _norm(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p) for p in params]))


def _compute(rounds: int) -> None:
    for label, shapes in SETS.items():
        params = [torch.randn(s) for s in shapes]
        fp, norm = [], []
        for _ in range(rounds):  # alternated, so that load on the machine hits both alike
            fp.append(_median_ms(_fingerprint, params))
            norm.append(_median_ms(_norm, params))
        f, n = statistics.median(fp), statistics.median(norm)
        print(f"{label:30s} fingerprint {f:8.3f} ms   norm {n:8.3f} ms   ratio {f / n:.2f}x")


def _side_by_side(label: str, names: list[str], params: list[torch.Tensor], rounds: int,
                  rank: int) -> None:
    # The check inside the lockstep agreement (acting policies) vs beside it (observe),
    # the agreement alone as the baseline: alternated, medians of `rounds`.
    cpu = torch.device("cpu")

    def agree_only() -> None:
        distributed.agree(False, None, cpu)

    def separate() -> None:
        distributed.agree(False, None, cpu)
        replicas.compare(0, names, params)

    def ride() -> None:
        per_tensor, head = replicas.fingerprint_head(names, params, cpu)
        distributed.ride(head, lambda rows: replicas.settle(0, names, per_tensor, rows))
        distributed.agree(False, None, cpu)

    got: dict[str, list[float]] = {"agree": [], "separate": [], "ride": []}
    for _ in range(rounds):
        got["agree"].append(_median_ms(agree_only))
        got["separate"].append(_median_ms(separate))
        got["ride"].append(_median_ms(ride))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in got.items()}
        print(f"{label:30s} agreement alone {med['agree']:.3f} ms; + the check beside it "
              f"{med['separate']:.3f} ms (+{med['separate'] - med['agree']:.3f}); riding "
              f"in it {med['ride']:.3f} ms (+{med['ride'] - med['agree']:.3f})")


def _worker(rank: int, port: int, rounds: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    for label, shapes in SETS.items():
        params = [torch.randn(s) for s in shapes]
        names = [f"p{i}" for i in range(len(params))]
        replicas.compare(0, names, params)  # warm-up
        ms = _median_ms(replicas.compare, 0, names, params, rounds=rounds)
        if rank == 0:
            print(f"{label:30s} compare() on 2 gloo ranks {ms:8.3f} ms (median of {rounds})")
        _side_by_side(label, names, params, rounds, rank)
    dist.destroy_process_group()


LM_CONFIGS = ("plain", "no_check", "ride", "separate")


def ddp_lm_rounds(rank: int, port: int, rounds: int, quick: bool, configs: tuple[str, ...],
                  make_guard):  # type: ignore[no-untyped-def]
    """The LM of overhead.py in DDP on 2 gloo ranks, one model per config (`make_guard(name,
    model, opt, wl)`: its Guard, or None), stepped once each per round in a seeded shuffled
    order (the same on both ranks), 3 warm-up rounds. Returns (workload, runs, step times)."""
    import random
    import sys
    from pathlib import Path

    from torch.nn.parallel import DistributedDataParallel as DDP

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from overhead import lm_workload

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    wl = lm_workload(quick, 0, torch.device("cpu"))
    runs = {}
    for name in configs:
        model, opt = wl.build()
        model = DDP(model)
        runs[name] = (model, opt, make_guard(name, model, opt, wl))
    times: dict[str, list[float]] = {n: [] for n in configs}
    warmup = 3
    for r in range(warmup + rounds):
        order = list(configs)
        random.Random(r).shuffle(order)
        x, y = wl.batches[(r + rank) % len(wl.batches)]
        for name in order:
            model, opt, guard = runs[name]
            t0 = time.perf_counter()
            loss = wl.loss(model(x), y)
            if guard is not None:
                guard.watch(loss=loss, batch=(x, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    return wl, runs, times


def _lm_worker(rank: int, port: int, rounds: int, quick: bool, out: str) -> None:
    from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig

    def make_guard(name, model, opt, wl):  # type: ignore[no-untyped-def]
        if name == "plain":
            return None
        cfg = GuardConfig(detect=DetectConfig(replica_every=0 if name == "no_check" else 1),
                          record=RecordConfig(summary=False))
        guard = Guard(model, opt, policy="skip", out=f"{out}/{name}-{rank}", config=cfg)
        if name == "separate":
            assert guard.replicas is not None
            guard.replicas.rides = False
        return guard

    wl, runs, times = ddp_lm_rounds(rank, port, rounds, quick, LM_CONFIGS, make_guard)
    if rank == 0:
        plain = statistics.median(times["plain"]) * 1e3
        base = statistics.median(times["no_check"]) * 1e3
        print(f"lm: {wl.describe}; DDP on 2 gloo ranks, policy='skip', {rounds} rounds")
        print(f"{'config':10s} {'median ms':>10s} {'per check ms':>13s} {'at every=100':>13s}")
        for name in LM_CONFIGS:
            med = statistics.median(times[name]) * 1e3
            if name in ("ride", "separate"):
                per = statistics.median(
                    a - b for a, b in zip(times[name], times["no_check"], strict=True)) * 1e3
                print(f"{name:10s} {med:10.2f} {per:13.3f} {per / 100 / plain:12.4%}")
            else:
                print(f"{name:10s} {med:10.2f}")
        print(f"guard without the check vs plain: {base / plain:.3f}x")
        for name in ("ride", "separate"):
            g = runs[name][2]
            assert g is not None and g.replicas is not None
            print(f"  {name}: {g.replicas.checks} checks, {g.replicas.rode} rode, "
                  f"{len(g.alarms)} alarms")
    for _, _, guard in runs.values():
        if guard is not None:
            guard.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--lm", action="store_true", help="the check's cost in DDP LM training")
    ap.add_argument("--quick", action="store_true", help="with --lm: a tiny LM (smoke)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; {torch.get_num_threads()} threads")
    if args.lm:
        import tempfile

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out:
            mp.spawn(_lm_worker, args=(port, args.rounds, args.quick, out), nprocs=2)
        return
    _compute(args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
