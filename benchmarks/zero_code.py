"""What `nanguard run` adds per step to an unmodified script (the guard, the in-process
recording of each step's model call and loss, resume points).

    python benchmarks/zero_code.py [--repeats 3]

Each script of the program suite runs as a subprocess at two lengths; the cost per step is the
difference of the wall times over the difference of the steps, so process start-up and the
import of torch cancel out. Configurations, alternated in every repeat: the script alone;
`nanguard run --fork-every 0` (no resume point); `nanguard run --fork-every 1` (a fork every
second, thirty times the default rate). Reported: the medians, ms per step, and the ratios to
the script alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "programs" / "scripts"

# (name, script, args for a run of `steps`)
WORKLOADS = {
    "raw logreg (2 tensors, SGD)": ("raw_logreg.py", lambda n: ["--epochs", str(n // 8),
                                                                "--lr", "0.01"]),
    "GRU tagger (Adam, masked mean)": ("masked_tokens.py", lambda n: ["--steps", str(n)]),
}
CONFIGS = {
    "alone": [],
    "run, no fork": ["-m", "nanguard", "run", "--fork-every", "0", "--replay-budget", "0"],
    "run, fork every 1 s": ["-m", "nanguard", "run", "--fork-every", "1", "--replay-budget",
                            "0"],
}


def _wall(config: list[str], script: Path, args: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, *config]
        if config:
            cmd += ["--out", str(Path(tmp) / "run")]
        start = time.perf_counter()
        proc = subprocess.run([*cmd, str(script), *args], cwd=tmp, capture_output=True,
                              text=True, check=False)
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{cmd} {script.name} failed:\n{proc.stderr[-2000:]}")
    return wall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--short", type=int, default=400)
    p.add_argument("--long", type=int, default=4000)
    a = p.parse_args()
    print(f"steps {a.short} vs {a.long}, {a.repeats} repeats, medians")
    print("| workload | config | ms per step | ratio to alone |")
    print("| --- | --- | --- | --- |")
    for name, (script, args) in WORKLOADS.items():
        per: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for _ in range(a.repeats):
            for config, flags in CONFIGS.items():
                short = _wall(flags, SCRIPTS / script, args(a.short))
                long = _wall(flags, SCRIPTS / script, args(a.long))
                per[config].append((long - short) / (a.long - a.short) * 1e3)
        base = statistics.median(per["alone"])
        for config, values in per.items():
            ms = statistics.median(values)
            print(f"| {name} | {config} | {ms:.3f} | {ms / base:.2f}x |")


if __name__ == "__main__":
    main()
