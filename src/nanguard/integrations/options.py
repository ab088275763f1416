"""The Guard options framework callbacks take, checked when the callback is built.

Shared by the Lightning and transformers adapters (neither framework is imported here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nanguard.config import GuardConfig

GUARD_OPTIONS = ("activations", "replay", "scheduler", "scaler", "config")
"""Guard keyword arguments a callback passes through (besides `policy` and `out`)."""


def check_options(policy: str | None, options: dict[str, Any]) -> None:
    """Refuse what the Guard would refuse, now rather than when training starts.

    Raises:
        ValueError: an unknown option, policy or config field.
    """
    unknown = sorted(set(options) - set(GUARD_OPTIONS))
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(unknown)}; the callback takes policy, "
                         f"out and: {', '.join(GUARD_OPTIONS)}")
    cfg = options.get("config")
    if cfg is not None and not isinstance(cfg, GuardConfig):
        raise ValueError(f"config must be a nanguard.GuardConfig, got {type(cfg).__name__}")
    cfg = dataclasses.replace(cfg) if cfg else GuardConfig()
    if policy is not None:
        cfg.policy = policy
    cfg.validate()
