"""The Guard options framework callbacks take, checked when the callback is built.

Shared by the Lightning and transformers adapters (neither framework is imported here).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from nanguard.config import GuardConfig
from nanguard.errors import NanguardError

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


def guard_setup(out: str | Path | None, config: GuardConfig | None, world: int, rank: int,
                resumed: dict[str, Any] | None, who: str) -> tuple[str | Path | None, GuardConfig]:
    """The run folder and config of a callback's Guard.

    Under multi-process training each rank records into `out/rank-R/` (only rank 0 prints a
    summary: the merged one). A guard resumed from a checkpoint (`resumed`: what the callback
    saved, with the run `folder`) keeps recording into that folder unless `out` says otherwise.

    Raises:
        ValueError: a multi-process run without `out`.
    """
    cfg = dataclasses.replace(config or GuardConfig())
    if world > 1:
        if out is None:
            raise ValueError(f"{who} under multi-process training needs out=: every rank "
                             "records into OUT/rank-R/")
        out = Path(out) / f"rank-{rank}"
        if rank != 0:
            cfg.record = dataclasses.replace(cfg.record, summary=False)
    if resumed is not None:
        if out is None and resumed.get("folder"):
            out = resumed["folder"]
        if cfg.record.if_exists == "refuse":  # the run folder of the interrupted run: go on
            cfg.record = dataclasses.replace(cfg.record, if_exists="resume")
    return out, cfg


def say_stopped(exc: NanguardError, flag: str) -> None:
    """The `raise` policy stopped training inside a framework's step (the guard closed and
    wrote its report): one line saying so, which `flag` the adapter set to stop the trainer
    its own way, and where the report is."""
    report = exc.report
    logging.getLogger("nanguard").error(
        "%s; stopping the Trainer (%s)%s", exc, flag,
        f", report in {report.run.get('folder')}"
        if report is not None and report.run.get("folder") else "")
