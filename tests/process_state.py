"""What an in-process `nanguard run` must leave as it found it.

Tests that call the runner in their own process (instead of a `python -m nanguard run`
subprocess, to save an interpreter start and a torch import per run) take a `snapshot()`
before and assert `unchanged(before)` after: a hook, patch, mode, flag or signal handler left
behind would change every later test of the worker (and a notebook user's next cell), so an
in-process runner that leaks fails the test that showed it, not some later one.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import torch
import torch.nn.modules.module as _module
import torch.optim.optimizer as _optim

# Callables the runner's discovery, manual-step watcher and entry-point tracker replace while
# a script runs (run/discovery.py, run/manual.py, pinpoint/entered.py).
_PATCHED = (
    (torch.Tensor, "backward"),
    (torch.optim.Optimizer, "__init__"),
    (torch.nn.utils, "clip_grad_norm_"),
    (torch, "tensor"),
    (torch, "as_tensor"),
    (torch, "load"),
    (torch, "save"),
)
_HOOK_TABLES = (
    "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called", "_global_backward_hooks",
    "_global_backward_pre_hooks", "_global_module_registration_hooks",
    "_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
)


def snapshot() -> dict[str, Any]:
    """The process-wide state a run could change, as comparable values."""
    return {
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "grad_enabled": torch.is_grad_enabled(),
        "anomaly": torch.is_anomaly_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "patched": {f"{getattr(o, '__name__', o)}.{n}": id(getattr(o, n)) for o, n in _PATCHED},
        "module_hooks": {t: len(getattr(_module, t, {})) for t in _HOOK_TABLES},
        "optimizer_hooks": (len(_optim._global_optimizer_pre_hooks),
                            len(_optim._global_optimizer_post_hooks)),
        "signals": {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)},
        "excepthook": sys.excepthook,
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "streams": (sys.stdout, sys.stderr),
        # The terminal handler `nanguard run` gives the logger stays, once per process, by
        # design (show/live.py's ensure_handler); any other handler, or a level, may not.
        "nanguard_log": ([h for h in logging.getLogger("nanguard").handlers
                          if not getattr(h, "_nanguard_own", False)],
                         logging.getLogger("nanguard").level),
    }


def unchanged(before: dict[str, Any]) -> None:
    """Assert that the process is as `before` (a `snapshot()`) found it."""
    after = snapshot()
    changed = {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    assert not changed, f"an in-process run left the process changed: {changed}"
