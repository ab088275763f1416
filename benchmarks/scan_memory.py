"""Peak memory of `nanguard scan` against the size of the file it scans.

Writes a large CSV and a large .npy into a temporary directory (deleted afterwards), runs
`python -m nanguard scan FILE --format json` on each in a child process, and reads the
child's peak RSS from os.wait4 (the same ru_maxrss that resource.getrusage reports for
children, but per child). A baseline child that only imports what scan imports gives the
fixed cost of the interpreter and libraries, so the ratio that matters is
(peak - baseline) / file size: well below 1 means the file was streamed, not loaded.

Usage: python benchmarks/scan_memory.py [--csv-mb 400] [--npy-mb 400]
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _child(args: list[str]) -> tuple[int, float, float]:
    """(exit code, peak RSS in MB, wall seconds) of one child process."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode not in (0, 1):
        raise SystemExit(f"child failed ({proc.returncode}): {err.strip()}")
    # ru_maxrss is in kilobytes on Linux, bytes on macOS.
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20
    return proc.returncode, usage.ru_maxrss * scale, time.perf_counter() - start


def _self_rss() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_csv(path: Path, target_mb: int, ncols: int = 16) -> int:
    import pyarrow as pa
    import pyarrow.csv as pcsv

    rng = np.random.default_rng(0)
    rows_per_batch = 100_000
    with pcsv.CSVWriter(path, pa.schema([(f"f{i}", pa.float64()) for i in range(ncols)])) as w:
        while path.stat().st_size < target_mb * 2**20:
            block = rng.normal(size=(rows_per_batch, ncols)).round(6)
            w.write_table(pa.table({f"f{i}": block[:, i] for i in range(ncols)}))
    return path.stat().st_size


def _write_npy(path: Path, target_mb: int, ncols: int = 64) -> int:
    rows = target_mb * 2**20 // (8 * ncols)
    arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(rows, ncols))
    rng = np.random.default_rng(1)
    for start in range(0, rows, 200_000):  # written in blocks so the writer stays small too
        arr[start : start + 200_000] = rng.normal(size=arr[start : start + 200_000].shape)
    arr.flush()
    del arr
    return path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv-mb", type=int, default=400)
    parser.add_argument("--npy-mb", type=int, default=400)
    parser.add_argument("--write", nargs=3, metavar=("KIND", "PATH", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:  # child mode: write one file
        kind, path, mb = args.write
        (_write_csv if kind == "csv" else _write_npy)(Path(path), int(mb))
        return
    baseline_code = "import nanguard.cli.main, nanguard.audit.scan, pyarrow.csv, pyarrow.parquet"
    _, baseline, _ = _child(["-c", baseline_code])
    print(f"benchmark process: peak RSS {_self_rss():.0f} MB")
    print(f"baseline (imports only): peak RSS {baseline:.0f} MB")
    result: dict[str, object] = {"baseline_rss_mb": round(baseline, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, mb in (("csv", args.csv_mb), ("npy", args.npy_mb)):
            path = Path(tmp) / f"big.{kind}"
            t0 = time.perf_counter()
            # Written by a child: a forked child's ru_maxrss starts at its parent's RSS, so
            # the parent must stay small for the scan's figure to be its own.
            _child([__file__, "--write", kind, str(path), str(mb)])
            size = path.stat().st_size / 2**20
            print(f"{kind}: wrote {size:.0f} MB in {time.perf_counter() - t0:.1f} s")
            code, peak, wall = _child(["-m", "nanguard", "scan", str(path), "--format", "json"])
            extra = peak - baseline
            print(f"{kind}: scan exit {code}, {wall:.1f} s, peak RSS {peak:.0f} MB, "
                  f"above baseline {extra:.0f} MB = {extra / size:.3f} x file size")  # fmt: skip
            result[kind] = {
                "file_mb": round(size, 1), "peak_rss_mb": round(peak, 1),
                "rss_over_baseline_mb": round(extra, 1),
                "peak_rss_to_file": round(peak / size, 3),
                "over_baseline_to_file": round(extra / size, 3),
                "scan_seconds": round(wall, 1), "throughput_mb_s": round(size / wall, 1),
            }  # fmt: skip
            path.unlink()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
