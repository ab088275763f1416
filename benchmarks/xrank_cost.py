"""What the cross-rank re-run check costs on a quiet step (nanguard.pinpoint.xrank).

Under an acting policy its request rides the agreement the ranks make every step anyway (a
fourth int32 in the same all-reduce). Under `observe` with a replay it adds that agreement:
one int32 all-reduce before every update. This measures that, side by side in training, on
the project's LM benchmark setting (benchmarks/overhead.py's transformer LM: 4 layers,
d_model 256, seq 128, batch 16, AdamW) in DDP on 2 gloo processes: plain DDP, the guard under
`observe` with `replay=` and `DetectConfig.cross_rank_rerun=False`, and the same with it on.
Each configuration has its own model; every round steps each once, in a seeded shuffled order
(the same on both ranks). `added` is the median over rounds of (on - off) in the same round.

Usage: python benchmarks/xrank_cost.py [--rounds 20] [--quick]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIGS = ("plain", "off", "on")


def _worker(rank: int, port: int, rounds: int, quick: bool, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from nanguard import DetectConfig, Guard, GuardConfig, RecordConfig
    from replicas import ddp_lm_rounds

    def make_guard(name, model, opt, wl):  # type: ignore[no-untyped-def]
        if name == "plain":
            return None
        cfg = GuardConfig(detect=DetectConfig(cross_rank_rerun=name == "on"),
                          record=RecordConfig(summary=False))
        return Guard(model, opt, out=f"{out}/{name}-{rank}", config=cfg,
                     replay=lambda b, m=model: wl.loss(m(b[0]), b[1]))

    wl, runs, times = ddp_lm_rounds(rank, port, rounds, quick, CONFIGS, make_guard)
    if rank == 0:
        plain = statistics.median(times["plain"]) * 1e3
        print(f"lm: {wl.describe}; DDP on 2 gloo ranks, policy='observe' with replay=, "
              f"{rounds} rounds")
        for name in CONFIGS:
            print(f"{name:6s} median {statistics.median(times[name]) * 1e3:9.2f} ms")
        added = statistics.median(
            a - b for a, b in zip(times["on"], times["off"], strict=True)) * 1e3
        print(f"added by the check (on - off, per step): {added:.3f} ms "
              f"= {added / plain:.2%} of a plain step")
        alarms = {n: len(g.alarms) for n, (_, _, g) in runs.items() if g is not None}
        print(f"alarms: {alarms}")
    for _, _, guard in runs.values():
        if guard is not None:
            guard.close()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a tiny LM (smoke)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}; {os.cpu_count()} CPUs; 1 thread per rank")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(port, args.rounds, args.quick, out), nprocs=2)


if __name__ == "__main__":
    main()
