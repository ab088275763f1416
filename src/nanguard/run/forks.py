"""What a resume point needs of the operating system (run/resume.py): whether this process
may be forked now, and the pipe and process calls that talk to a point's child."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import torch


def fork_refusal(copies: int) -> str | None:
    """Why this process cannot be forked safely now, with memory for `copies` children that
    may each end up holding a full copy of it (None: it can)."""
    import multiprocessing

    if not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"):
        return "no fork() here"
    if torch.cuda.is_initialized():
        return "CUDA is in use (a CUDA context does not survive a fork)"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "torch.distributed is in use"
    if multiprocessing.active_children():
        return "the run holds worker processes (DataLoader workers)"
    try:
        if any(_link(fd).startswith("socket:") for fd in os.listdir("/proc/self/fd")):
            return "the run holds a socket (an experiment tracker's connection?)"
        rss = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        available = _mem_available()
    except OSError as exc:
        return f"cannot inspect the process ({exc})"
    if available is not None and rss * copies > available:
        return f"not enough free memory for {copies} copies of {rss >> 20} MiB"
    return None


def _link(fd: str) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed since the listing (the listing's own fd)
        return ""


def _mem_available() -> int | None:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def read_line(fd: int) -> str:
    """One line from the pipe `fd`, stripped (what came before EOF if the writer is gone)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 4096)
        if not chunk:  # the run is gone
            break
        data += chunk
    return data.decode().strip()


def wait_exit(pid: int, budget: float) -> int | None:
    """The child's exit code, or None (it was killed) when it ran past `budget` seconds."""
    deadline = time.monotonic() + budget
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            kill_group(pid)
            return None
        time.sleep(0.02)


def kill_group(pid: int) -> None:
    """Kill the child `pid` and the session it leads, and reap it."""
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
