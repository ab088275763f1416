"""Helpers for the `nanguard run` tests: real subprocesses with the package importable, or the
command's `main` in the test's process (`nanguard_here`) where no process boundary is tested."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import in_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH")) if p)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


def run(args: list[str], cwd: Path, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in `cwd`; kills it (by pid, through `subprocess.run`) past `timeout`."""
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(), capture_output=True,
                          text=True, timeout=timeout)


def nanguard_run(out: Path, script: str | Path, *script_args: str, options: tuple[str, ...] = (),
                 cwd: Path | None = None, timeout: float = 90
                 ) -> subprocess.CompletedProcess[str]:
    return run(["-m", "nanguard", "run", "--out", str(out), *options, str(script),
                *script_args], cwd=cwd or out.parent, timeout=timeout)


def nanguard_here(out: Path, script: str | Path, *script_args: str,
                  options: tuple[str, ...] = (), cwd: Path | None = None
                  ) -> subprocess.CompletedProcess[str]:
    """What `nanguard_run` gives (exit code, stdout, stderr), from `main` in this process: no
    interpreter start and torch import; asserts the run left the process as it found it."""
    return in_process.nanguard(["run", "--out", str(out), *options, str(script), *script_args],
                               cwd or out.parent)


def report(folder: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((folder / "report.json").read_text())
    return data


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def torchrun(out: Path, nproc: int, options: tuple[str, ...], script: Path, *script_args: str,
             timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """`python -m torch.distributed.run ... -m nanguard run ...` on a free port. Past `timeout`
    the launcher and its workers (its own session) are killed and TimeoutExpired is raised."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           "-m", "nanguard", "run", "--out", str(out), *options, str(script), *script_args]
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
