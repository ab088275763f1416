"""What resume points cost and what they save (run/resume.py).

    python benchmarks/resume_points.py [--sizes 10,100,400]

1. Taking a point: `os.fork()` of a process holding an MLP of about S MB of parameters plus
   Adam's state, and the first optimizer steps after it, when the parent's writes copy the
   shared pages (copy-on-write), against the same steps without a fork, in the same process.
2. What it saves: `nanguard run` on the textbook raw-tensor script (tests/programs/scripts/
   raw_logreg.py, NaN at step 1531 of 2000), the re-run that pinpoints the origin from a resume
   point (`--fork-every 0.3`) against the re-run of the script from its start
   (`--fork-every 0`), seconds as `run.replay.seconds` reports them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "programs" / "scripts" / "raw_logreg.py"


def _model(mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    width = int((mb * 2**20 / 4 / 2) ** 0.5)  # two square layers of float32
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                torch.nn.Linear(width, width))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4), torch.randn(16, width)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.perf_counter() - start) * 1e3


def fork_cost(mb: int, repeats: int = 5) -> dict[str, float]:
    model, opt, x = _model(mb)
    _steps(model, opt, x, 3)
    forks, after, plain = [], [], []
    for _ in range(repeats):
        plain.append(_steps(model, opt, x, 2))
        r, w = os.pipe()
        t0 = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os.read(r, 1)
            os._exit(0)
        forks.append((time.perf_counter() - t0) * 1e3)
        after.append(_steps(model, opt, x, 2))
        os.write(w, b"q")
        os.waitpid(pid, 0)
        os.close(r)
        os.close(w)
    return {"MB": mb, "fork_ms": statistics.median(forks),
            "two_steps_ms": statistics.median(plain),
            "two_steps_after_fork_ms": statistics.median(after)}


def replay_seconds(fork_every: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        subprocess.run([sys.executable, "-m", "nanguard", "run", "--out", str(out),
                        "--fork-every", fork_every, str(SCRIPT), "--epochs", "250",
                        "--lr", "0.1"], capture_output=True, text=True, cwd=tmp, check=False)
        report = json.loads((out / "report.json").read_text())
    replay = report["run"]["replay"]
    return {"fork_every": fork_every, "status": replay["status"], "mode": replay.get("mode"),
            "from_step": replay.get("from_step"), "seconds": replay.get("seconds"),
            "op": report["first_nonfinite"].get("op")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="10,100,400")
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| params MB | fork ms | 2 steps ms | 2 steps after a fork ms |")
    print("| --- | --- | --- | --- |")
    for mb in (int(s) for s in args.sizes.split(",")):
        c = fork_cost(mb)
        print(f"| {mb} | {c['fork_ms']:.1f} | {c['two_steps_ms']:.1f} | "
              f"{c['two_steps_after_fork_ms']:.1f} |")
    print()
    print("| --fork-every | replay | mode | from step | seconds | op |")
    print("| --- | --- | --- | --- | --- | --- |")
    for every in ("0.3", "0"):
        r = replay_seconds(every)
        print(f"| {every} | {r['status']} | {r['mode']} | {r['from_step']} | {r['seconds']} | "
              f"{r['op']} |")


if __name__ == "__main__":
    main()
