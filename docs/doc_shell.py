"""Runs the shell commands the docs show, as a reader would: in a folder holding a copy of
examples/, with `nanguard` resolved as `python -m nanguard` from this checkout (src/ on
PYTHONPATH) and `python` as the running interpreter.

A command that trains (`nanguard run`, `nanguard demo`) is run once per process: a second page
showing the same command gets the same output and a copy of the files it wrote (when they are
not there already), so pages that read the same run share one training.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import io
import os
import pty
import re
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import termios
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = 100  # transcripts are taken at this terminal width, so they read the same everywhere
TIMEOUT = 120.0

_PRELUDE = (
    'nanguard() { "$NANGUARD_DOCS_PY" -m nanguard "$@"; }\n'
    'python() { "$NANGUARD_DOCS_PY" "$@"; }\n'
    "set -o pipefail\n"
)
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_TRAINS = ("nanguard run ", "nanguard demo")
# Commands that read files and train nothing run in this process (no interpreter and torch to
# start for each): the same `main()` the console script calls, in the same folder.
_IN_PROCESS = re.compile(r"^nanguard (report|lint|audit|scan|export)\b[^|<>;&$`*?]*$")


@dataclass
class Result:
    command: str
    returncode: int
    output: str  # stdout and stderr as they were interleaved, ANSI codes and \r removed
    seconds: float


_memo: dict[tuple[str, bool], tuple[Result, Path, list[str]]] = {}


def workspace(path: Path) -> Path:
    """Make `path` a reader's folder: a copy of examples/ (no run folders, no caches)."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "examples", path / "examples", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "runs", "nanguard_runs"))
    return path


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "COV_", "NANGUARD_"))}
    env.update(
        NANGUARD_DOCS_PY=sys.executable,
        PYTHONPATH=str(ROOT / "src"),
        COLUMNS=str(COLUMNS), LINES="50", NO_COLOR="1", TERM="xterm",
        PYTHONHASHSEED="0", WANDB_SILENT="true",
    )
    return env


def run(command: str, cwd: Path, *, tty: bool = False, timeout: float = TIMEOUT) -> Result:
    """Run one command line of the docs in `cwd`; `tty=True` gives it a terminal (as a reader's
    terminal shows it: nanguard's live lines are formatted for a terminal)."""
    # The same command with another comment is the same run (pages comment it differently).
    key = (" ".join(shlex.split(command, comments=True)), tty)
    if command.startswith(_TRAINS) and key in _memo:
        result, saved, made = _memo[key]
        if not any((cwd / name).exists() for name in made):
            for name in made:
                src, dst = saved / name, cwd / name
                shutil.copytree(src, dst) if src.is_dir() else shutil.copy2(src, dst)
            return result
    before = set(os.listdir(cwd))
    start = time.monotonic()
    if _IN_PROCESS.match(command.split("#")[0].strip()):
        output, code = _run_here(command.split("#")[0].strip(), cwd)
    else:
        output, code = (_run_tty if tty else _run_pipe)(command, cwd, timeout)
    output = "\n".join(line.rstrip() for line in _ANSI.sub("", output).replace("\r", "")
                       .splitlines())
    result = Result(command, code, output, time.monotonic() - start)
    if command.startswith(_TRAINS):
        made = sorted(set(os.listdir(cwd)) - before)
        saved = Path(tempfile.mkdtemp(prefix="nanguard-docs-memo-"))
        atexit.register(shutil.rmtree, saved, True)
        for name in made:
            src = cwd / name
            shutil.copytree(src, saved / name) if src.is_dir() else shutil.copy2(src, saved)
        _memo[key] = (result, saved, made)
    return result


def _run_here(command: str, cwd: Path) -> tuple[str, int]:
    if str(ROOT / "src") not in sys.path:
        sys.path.insert(0, str(ROOT / "src"))
    from nanguard.cli.main import main

    out = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(shlex.split(command)[1:])
            except SystemExit as exc:  # argparse's way out of a bad command line
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        os.chdir(old)
    return out.getvalue(), code


def _run_pipe(command: str, cwd: Path, timeout: float) -> tuple[str, int]:
    proc = subprocess.Popen(["bash", "-c", _PRELUDE + command], cwd=cwd, env=environment(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, _ = proc.communicate()
        return out + f"\n[timed out after {timeout:.0f} s]", 124
    return out, proc.returncode


def _kill(proc: subprocess.Popen[Any]) -> None:
    """The command's whole process group: bash and the interpreter it started."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _run_tty(command: str, cwd: Path, timeout: float) -> tuple[str, int]:
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLUMNS, 0, 0))
    proc = subprocess.Popen(["bash", "-c", _PRELUDE + command], cwd=cwd, env=environment(),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            start_new_session=True)
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            _kill(proc)
            chunks.append(f"\n[timed out after {timeout:.0f} s]".encode())
    finally:
        os.close(master)
    return b"".join(chunks).decode(errors="replace"), proc.wait()


def normalise(text: str) -> str:
    """What may differ between two runs of the same command: dates, times, durations, pids,
    temporary folders. Everything else of a transcript must match."""
    text = re.sub(r"\d{8}-\d{6}(-\d+)*", "<time>", text)
    text = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)? ?(s|ms|µs|us|min)\b", "<dur>", text)
    text = re.sub(r"/tmp/\S+", "<tmp>", text)
    text = re.sub(r"\bpid \d+", "pid <n>", text)
    return text
