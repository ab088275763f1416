"""`nanguard ARGS` run by the command's own `main` in the test's process.

What a black-box `python -m nanguard ...` subprocess gives a test (exit code, stdout, stderr,
the files it wrote), without an interpreter start and a torch import (~2 s of CPU each), for
tests of what a command prints, records or returns. A test of what only a process of its own
shows (a real exit status after `os._exit`, a signal, torchrun, a crash, the installed entry
point) keeps its subprocess. The run must leave the process as it found it: asserted after
each call (tests/process_state.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy
import torch

import process_state


def nanguard(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`nanguard ARGV` from `cwd`: its exit code and what it (and a script it ran) printed.

    Must be called on the main thread: `nanguard run` installs its SIGTERM handler while the
    script runs, which only the main thread may do.
    """
    from nanguard.cli.main import main

    before = process_state.snapshot()
    # What lasts only as long as the command's process, restored after it here: the level
    # --quiet / --log-level give the `nanguard` logger, and what the script itself changes for
    # its process (`sys.path`, the environment: Lightning's PL_GLOBAL_SEED; the warning
    # filters; the global RNGs it seeds), so that later tests of this worker see none of it.
    level, path, environ = logging.getLogger("nanguard").level, sys.path[:], dict(os.environ)
    rngs = (random.getstate(), torch.random.get_rng_state(), numpy.random.get_state())
    # A process of its own starts with no root handlers, so the live lines go to its stderr
    # (show/live.py leaves them to the root's handlers once a program configured logging);
    # pytest's log capture handlers are lifted off the root while the command runs.
    root = logging.getLogger()
    root_handlers, root.handlers = root.handlers, []
    stdout, stderr = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr), \
                warnings.catch_warnings():
            try:
                code = main(argv)
            except SystemExit as e:  # argparse and friends: the process would exit with it
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
        root.handlers = root_handlers
        logging.getLogger("nanguard").setLevel(level)
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)
        random.setstate(rngs[0])
        torch.random.set_rng_state(rngs[1])
        numpy.random.set_state(rngs[2])
    process_state.unchanged(before)
    return subprocess.CompletedProcess(["nanguard", *argv], code, stdout.getvalue(),
                                       stderr.getvalue())
