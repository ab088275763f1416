"""What a checkpoint manifest costs: `nanguard.save` against `torch.save`, alternated in one run,
and the hashing rate of `write_manifest` from memory and from a file.

Usage: python benchmarks/manifest.py [--mb 256] [--rounds 3]
Prints the median of each, seconds per GB hashed, and the ratio to `torch.save`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import nanguard
from nanguard.audit import audit_checkpoint, write_manifest


def _state(mb: int) -> dict[str, torch.Tensor]:
    # Square float32 matrices of 4 MB each plus small vectors: a model's mix of big and small.
    torch.manual_seed(0)
    n = mb // 4
    state = {f"layers.{i}.weight": torch.randn(1024, 1024) for i in range(n)}
    state.update({f"layers.{i}.bias": torch.randn(1024) for i in range(n)})
    return state


def _time(fn) -> float:  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _save_fsync(state: dict[str, torch.Tensor], path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    state = _state(args.mb)
    gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "torch.save",
            "torch.save+fsync",
            "nanguard.save",
            "hash mem",
            "hash file",
            "audit",
            "audit+manifest",
        )
    }
    with tempfile.TemporaryDirectory() as d:
        plain, guarded = os.path.join(d, "plain.pt"), os.path.join(d, "guarded.pt")
        for _ in range(args.rounds):
            times["torch.save"].append(_time(lambda: torch.save(state, plain)))
            times["torch.save+fsync"].append(_time(lambda: _save_fsync(state, plain)))
            times["nanguard.save"].append(_time(lambda: nanguard.save(state, guarded)))
            times["hash mem"].append(
                _time(lambda: write_manifest(state, plain, manifest=plain + ".m.json"))
            )
            times["hash file"].append(
                _time(lambda: write_manifest(plain, manifest=plain + ".m.json"))
            )
            times["audit"].append(_time(lambda: audit_checkpoint(plain)))
            times["audit+manifest"].append(_time(lambda: audit_checkpoint(guarded)))
    base = statistics.median(times["torch.save"])
    print(
        f"state dict: {gb:.3f} GB float32, {len(state)} tensors; torch {torch.__version__}; "
        f"{os.cpu_count()} CPUs; median of {args.rounds} rounds"
    )
    for name, ts in times.items():
        med = statistics.median(ts)
        ratio = "" if name.startswith(("hash", "audit")) else f"  {med / base:.2f}x torch.save"
        print(f"{name:16s} {med:7.3f} s  {med / gb:6.2f} s/GB{ratio}")


if __name__ == "__main__":
    main()
