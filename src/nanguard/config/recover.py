"""The acting side's settings (`nanguard.recover`): `RecoverConfig` (rollback, skip's
escalation), `ClipConfig` (adaptive clipping), `HealConfig` (the `heal` policy) and
`AmpConfig` (GradScaler awareness)."""

from __future__ import annotations

from dataclasses import dataclass

from nanguard.config.strict import strict


@strict
@dataclass(kw_only=True)
class RecoverConfig:
    """The `rollback` policy."""

    snapshot_every: int = 10
    """Take a snapshot of the last good state (host copy of what the optimizer trains, its
    state, buffers, RNG) every K quiet steps, into the ring (`snapshot_slots`). A capture
    copies that state once (on a small model about one step's time), so K spreads the copy
    over K steps: 10 keeps it a small share of step time (BENCHMARKS.md, "Recovery")."""

    snapshot_slots: int = 2
    """Snapshots kept in the ring: a rollback restores the newest one taken before the trouble
    began (by default one recent, one older: the recent one may already lie inside a
    cascade's lead-up). Each slot holds one copy; 1 keeps a single last good state."""

    snapshot_budget_mb: float | None = None
    """Host memory (MiB) all snapshots together may hold; slots beyond the first are kept only
    within it. None: no limit beyond `snapshot_slots`. One snapshot is always kept (rollback
    needs it), even when it alone is larger: the report's `recovery.snapshot_over_budget`
    then says so. The memory held is in the report (`recovery.snapshot_bytes`)."""

    quiet_steps: int = 10
    """...only from a state with no warning in the last this many steps (never from inside a
    cascade)."""

    backoff_factor: float = 0.5
    """After a rollback, the LR is backed off only as far as the evidence calls for
    (`nanguard.recover.backoff`): kept after a spike or a NaN batch with no growth; x this
    after a NaN with no growth before it; x min(this, 1/g) after measured growth of g x per
    step; a repeat within `window` compounds. 1.0: never backed off..."""

    backoff_steps: int = 100
    """...for this many steps, then the scheduler's LR is used again."""

    backoff_min: float = 0.1
    """The deepest cut one rollback makes for measured growth (a cascade's last steps grow
    1e3x per step and more: the runaway's own rate, not the LR's)."""

    max_consecutive_skips: int = 10
    """`skip` never loops: after this many updates discarded in a row it escalates (see
    `skip_escalation`)."""

    skip_escalation: str = "raise"
    """What `skip` escalates to when skipping cannot heal (`max_consecutive_skips` in a row, or
    a bad update already applied): `raise` (stop with the report, `give_up` action) or
    `rollback` (restore a snapshot from before the trouble, as the `rollback` policy does;
    `skip` then keeps the snapshot ring, with its memory)."""

    max_rollbacks: int = 3
    """Give up (stop with the report, like `raise`) after this many rollbacks..."""

    window: int = 1000
    """...within this many steps."""


@strict
@dataclass(kw_only=True)
class ClipConfig:
    """Adaptive clipping: scale gradients down to mean + z * std of the recent grad norms."""

    z: float = 3.0
    """Threshold in standard deviations of the EMA of the grad norm."""

    ema: float = 0.02
    """EMA factor of the mean and variance."""

    warmup_steps: int = 25
    """Steps of statistics before clipping starts (a plain running mean meanwhile)."""


@strict
@dataclass(kw_only=True)
class HealConfig:
    """The `heal` policy (`nanguard.recover.heal`): clip a loss spike's precursor before its
    update, and cut the weight decay or the LR when precursors recur."""

    ratio: float = 3.0
    """A grad norm above this many times its rolling mean..."""

    z: float = 6.0
    """...and more than this many rolling standard deviations above it is a precursor (both
    are needed: healthy runs never reach them at the defaults, tests/recover/test_heal.py)."""

    ema: float = 0.02
    """EMA factor of the grad norm's rolling mean and variance (~50 steps)."""

    warmup_steps: int = 50
    """Steps of statistics before acting (a plain running mean meanwhile)."""

    correct_after: int = 2
    """Precursors (clipped steps; two adjacent steps of one jump count as two) within
    `window` steps that call for correcting the cause..."""

    window: int = 1000
    """...within this many steps."""

    correct: str = "auto"
    """How: `auto` (cut the weight decay when the optimizer decays weights and the weight norm
    fell by > 10% while the precursors came, else the LR), `wd` (the weight decay whenever the
    optimizer has one, else the LR), `lr` (always the LR), `none` (clip only)."""

    cut_factor: float = 0.5
    """Each cut multiplies the weight decay or the LR by this."""

    max_cuts: int = 3
    """At most this many cuts over the run."""

    ramp_steps: int = 100
    """After an LR jump without warm-up (up >= 3x in one step, a resume included), the LR is
    ramped back up from its pre-jump value over this many steps (0: no ramp)."""


@strict
@dataclass(kw_only=True)
class AmpConfig:
    """GradScaler awareness (when a scaler is given to the guard)."""

    min_scale: float = 1.0
    """A loss scale below this is a collapse alarm."""

    max_halvings: int = 8
    """So are this many overflow back-offs in a row without the scale growing again."""

    stall_steps: int = 20
    """`watch()` calls without an optimizer step (every step skipped by the scaler) after which
    the scale is read to check for a collapse."""
