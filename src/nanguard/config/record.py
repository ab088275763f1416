"""`RecordConfig`: where the run store writes and what it keeps."""

from __future__ import annotations

from dataclasses import dataclass

from nanguard.config.strict import strict

IF_EXISTS = ("refuse", "overwrite", "resume")
"""`RecordConfig.if_exists`: what an explicit run folder that already holds a run gets."""


@strict
@dataclass(kw_only=True)
class RecordConfig:
    """Where and what the run store keeps."""

    out: str | None = None
    """Run folder. None: `nanguard_runs/<timestamp>` under the current directory. "" disables
    recording (in-memory only)."""

    rng_every: int = 100
    """Store the RNG states at the start of every N-th step (and always at alarm steps)."""

    summary: bool = True
    """Print the terminal summary when the guard closes."""

    if_exists: str = "refuse"
    """An explicit `out` folder that already holds a run (a run.db): `refuse` (ValueError),
    `overwrite` (the old record is deleted) or `resume` (steps are appended to it, e.g. with
    `load_state_dict` after a restart). Default folders (`out=None`) never collide: each gets
    a unique name."""

    def __post_init__(self) -> None:
        if self.if_exists not in IF_EXISTS:
            raise ValueError(f"unknown record.if_exists {self.if_exists!r}; "
                             f"use one of: {', '.join(IF_EXISTS)}")
