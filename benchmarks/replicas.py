"""What one replica check costs (nanguard.watch.replicas): the fingerprint of the parameters
against `torch.linalg.vector_norm` over the same tensors (what `clip_grad_norm_` computes),
alternated in one run, and the whole check (`compare`: fingerprint + all_gather) in a 2-process
gloo group on this machine.

Usage: python benchmarks/replicas.py [--rounds 20]
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

from nanguard.watch import replicas

SETS = {
    "400 small tensors (64x64)": [(64, 64)] * 400,
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
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; {torch.get_num_threads()} threads")
    _compute(args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(port, args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
