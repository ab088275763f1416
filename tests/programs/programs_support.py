"""Helpers for the realistic-program suite: run a script plainly or under the independent tracer
(`scripts/_nantrace.py`, plain PyTorch), each in a real subprocess, or under `nanguard run` (in
this process unless a test needs a process of its own), and the data files the failure cases
need."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import in_process

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT = 120


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    # NANGUARD_SRC: run the suite against another copy of the package (e.g. a snapshot).
    src = os.environ.get("NANGUARD_SRC") or str(ROOT / "src")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (src, e.get("PYTHONPATH")) if p)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    e.pop("NANTRACE", None)
    e.update(extra)
    return e


def python(args: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(**extra),
                          capture_output=True, text=True, timeout=TIMEOUT)


def script(name: str) -> str:
    return str(SCRIPTS / name)


def plain(cwd: Path, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The script alone, no nanguard, no tracer."""
    return python([script(name), *args], cwd)


@dataclass
class Guarded:
    proc: subprocess.CompletedProcess[str]
    out: Path
    report: dict[str, Any]

    @property
    def first(self) -> dict[str, Any]:
        first: dict[str, Any] = self.report["first_nonfinite"]
        return first

    @property
    def causes(self) -> list[str]:
        return [d["cause"] for d in self.report.get("diagnosis") or []]

    def explain(self) -> str:
        """What to show when an assertion fails."""
        rep = {k: self.report.get(k) for k in ("status", "steps", "first_nonfinite",
                                               "diagnosis", "run")}
        return (f"exit {self.proc.returncode}\nreport: {json.dumps(rep, default=str)[:3000]}\n"
                f"stderr tail:\n{self.proc.stderr[-3000:]}")


@dataclass
class Trace:
    """What the tracer saw: the first non-finite finding (None: none) and the update steps."""

    first: dict[str, Any] | None
    steps: int | None
    stderr: str = ""
    """The script's stderr under the tracer (lines a script prints there for its test)."""


def trace(cwd: Path, name: str, *args: str) -> Trace:
    """The script under the independent tracer."""
    r = python([script(name), *args], cwd, NANTRACE="1")
    found = [json.loads(ln.split(" ", 1)[1]) for ln in r.stderr.splitlines()
             if ln.startswith("NANTRACE ")]
    end = [json.loads(ln.split(" ", 1)[1]) for ln in r.stderr.splitlines()
           if ln.startswith("NANTRACE_END ")]
    assert len(found) <= 1 and len(end) == 1, r.stderr[-3000:]
    return Trace(found[0] if found else None, end[0]["steps"], r.stderr)


def both(cwd: Path, name: str, *args: str,
         prepare: Callable[[Path], object] | None = None,
         options: tuple[str, ...] = (), process: bool = False) -> tuple[Trace, Guarded]:
    """The tracer run and the `nanguard run` of the same command, side by side (the tracer's
    process runs while `nanguard run` runs here, or in a process of its own with `process`),
    each in a folder of its own (`cwd/trace`, `cwd/guarded`) that `prepare(folder)` fills
    first (data files, checkpoints), so that files the script writes never collide. `options`
    go to `nanguard run`."""
    dirs = []
    for sub in ("trace", "guarded"):
        (cwd / sub).mkdir()
        if prepare is not None:
            prepare(cwd / sub)
        dirs.append(cwd / sub)
    with ThreadPoolExecutor(1) as pool:
        traced = pool.submit(trace, dirs[0], name, *args)
        # On this (the main) thread: the runner installs its SIGTERM handler while the
        # script runs, which only the main thread may do.
        run = guarded(dirs[1], name, *args, options=options, process=process)
        return traced.result(), run


def guarded(cwd: Path, name: str, *args: str, out: str = "run",
            policy: str | None = None, options: tuple[str, ...] = (),
            process: bool = False) -> Guarded:
    """`nanguard run --out DIR [--policy P] [OPTIONS] SCRIPT ARGS` from `cwd`: the command's
    own `main` in this process (what `python -m nanguard` calls: its exit code and what it
    and the script printed), or with `process` a `python -m nanguard run` subprocess, for a
    test of what only a process of its own shows (its real exit status, a fork, a crash).

    In this process the run saves an interpreter start and a torch import (~2 s of CPU), and
    the script's imports are cached for the next test; the run must leave the process as it
    found it (tests/process_state.py), which tests/in_process.py asserts."""
    opts = (["--policy", policy] if policy else []) + list(options)
    folder = cwd / out
    argv = ["run", "--out", str(folder), *opts, script(name), *args]
    # NANGUARD_SRC (another copy of the package) can only be imported by a process of its own.
    if process or os.environ.get("NANGUARD_SRC"):
        proc = python(["-m", "nanguard", *argv], cwd)
    else:
        proc = in_process.nanguard(argv, cwd)
    path = folder / "report.json"
    assert path.is_file(), f"no report.json; exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return Guarded(proc, folder, json.loads(path.read_text()))


def script_line(name: str, text: str) -> int:
    """1-based number of the only line of script `name` that holds `text`."""
    lines = [i for i, t in enumerate((SCRIPTS / name).read_text().splitlines(), 1) if text in t]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def script_where(name: str, text: str) -> str:
    """`name:LINE` of the only line of script `name` that holds `text`."""
    return f"{name}:{script_line(name, text)}"


def noted(g: Guarded, what: str) -> int:
    """K of the script's own `NOTE {what} at update K` (printed once), from its stdout."""
    found = re.findall(rf"NOTE {re.escape(what)} at update (\d+)", g.proc.stdout)
    assert len(found) == 1, g.proc.stdout[-2000:]
    return int(found[0])


def finding_of(g: Guarded) -> dict[str, Any]:
    """Status, first non-finite step, op, source file:line and top cause of a guarded run."""
    first = g.report.get("first_nonfinite") or {}
    return {"status": g.report["status"], "step": first.get("step"), "op": first.get("op"),
            "source": Path(str(first.get("source"))).name,
            "cause": g.causes[0] if g.causes else None}


def report_exit(folder: Path) -> int:
    """Exit code of `nanguard report DIR`, run in this process: what the test reads is the
    code the command's `main` returns (`python -m nanguard` exits with it); a process of its
    own cost ~2.5 s of CPU (importing torch) for nothing the test checks."""
    from nanguard.cli.main import main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            return main(["report", str(folder)])
        except SystemExit as e:  # argparse and friends: the process would exit with it
            return e.code if isinstance(e.code, int) else 1


# ------------------------------------------------------------------------------- data files


def write_load_csv(path: Path, rows: int = 600, nan_row: int | None = None,
                   gap: int = 1) -> Path:
    """Hourly temperature / humidity / load readings; `nan_row` (and the `gap - 1` rows after
    it) get an empty humidity cell."""
    rng = random.Random(0)
    with path.open("w") as f:
        f.write("timestamp,temperature,humidity,load\n")
        for i in range(rows):
            day = math.sin(2 * math.pi * i / 24)
            t = 15 + 8 * day + rng.gauss(0, 0.5)
            h = 0.6 - 0.2 * day + rng.gauss(0, 0.02)
            load = 1 + 0.04 * (t - 15) + 0.3 * math.sin(2 * math.pi * i / 12) + rng.gauss(0, .05)
            hs = "" if nan_row is not None and nan_row <= i < nan_row + gap else f"{h:.4f}"
            f.write(f"2024-01-{1 + i // 24:02d}T{i % 24:02d}:00,{t:.3f},{hs},{load:.4f}\n")
    return path


def write_points_csv(path: Path, n: int = 1024, nan_row: int | None = None) -> Path:
    """Points around 8 centres on a circle of radius 2; `nan_row` gets x = nan."""
    rng = random.Random(1)
    with path.open("w") as f:
        f.write("x,y\n")
        for i in range(n):
            a = rng.randrange(8) * 2 * math.pi / 8
            x, y = 2 * math.cos(a) + rng.gauss(0, .05), 2 * math.sin(a) + rng.gauss(0, .05)
            f.write(("nan" if i == nan_row else f"{x:.4f}") + f",{y:.4f}\n")
    return path
