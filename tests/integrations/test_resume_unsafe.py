"""When the run must not fork, no resume point is taken (run/forks.py): each condition
made for real in a fresh interpreter, one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_python

CHECK = """
import multiprocessing, socket, time
from nanguard.run.forks import fork_refusal
print("clean:", fork_refusal(2))
{make}
print("then:", fork_refusal(2))
"""

CONDITIONS = {
    "a socket": ("s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)", "holds a socket"),
    "a worker process": (
        "p = multiprocessing.get_context('fork').Process(target=time.sleep, args=(30,),\n"
        "                                                daemon=True)\n"
        "p.start()", "worker processes"),
    "torch.distributed": (
        "import os, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='29581')\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)", "torch.distributed"),
}


@pytest.mark.parametrize("name", list(CONDITIONS))
def test_no_fork_while(tmp_path: Path, name: str) -> None:
    make, reason = CONDITIONS[name]
    r = run_python(tmp_path, "-c", CHECK.format(make=make), timeout=120)
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines() if ": " in line)
    assert lines.get("clean") == "None", r.stdout + r.stderr
    assert reason in lines.get("then", ""), r.stdout + r.stderr
