"""Which process writes a run, so that a reader can tell a run still training from one that died.

The run store writes `process` into run.db's meta when it opens: the host, the pid and
what makes that pid unique over time (the kernel's boot id and the process's start tick, where
/proc has them). A run with no report.json is `running` while that very process is alive on
this host, and `died` once it is gone (a pid reused by another process does not count).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any


def _start_tick(pid: int) -> int | None:
    """The start time of `pid` in clock ticks since boot (Linux /proc), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def identity() -> dict[str, Any]:
    """This process, as `alive` recognizes it later."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "boot_id": _boot_id(),
            "start_tick": _start_tick(pid)}


def alive(ident: Any) -> bool | None:
    """Is the process `identity()` described still running? None when this host cannot tell
    (another host, or a record without the identity)."""
    if not isinstance(ident, dict) or not isinstance(ident.get("pid"), int):
        return None
    if ident.get("host") != socket.gethostname():
        return None
    if ident.get("boot_id") and _boot_id() and ident["boot_id"] != _boot_id():
        return False  # the machine rebooted since
    pid = ident["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, owned by someone else
    tick = ident.get("start_tick")
    if tick is not None:
        now = _start_tick(pid)
        if now is not None and now != tick:
            return False  # the pid was reused by another process
        if now is None and Path("/proc").is_dir():
            return False  # /proc is there but the pid vanished in between
    return True
