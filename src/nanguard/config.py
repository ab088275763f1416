"""Configuration of a Guard: nested keyword-only dataclasses, one docstring per field.

Defaults are chosen so that a healthy run never raises an alarm (see tests/test_false_alarms.py)
while the LR/momentum cascade is flagged several steps before its first non-finite value.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

POLICIES = ("observe", "raise", "skip", "rollback", "heal")
OBJECTIVES = ("auto", "stationary", "nonstationary")
"""`DetectConfig.objective`: is the loss a stationary series (`nanguard.detect.objective`)."""

IF_EXISTS = ("refuse", "overwrite", "resume")

_C = TypeVar("_C")


def _strict(cls: type[_C]) -> type[_C]:
    """Make a config dataclass reject a misspelled field with a ValueError that lists the
    valid names (the generated `__init__` would raise a bare TypeError)."""
    init = cls.__init__
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; "
                             f"valid fields: {', '.join(names)}")
        init(self, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_strict
@dataclass(kw_only=True)
class WatchConfig:
    """What is measured each step, and how often the host reads it."""

    read_every: int = 1
    """Read the device-side statistics every N steps (one host read per N steps, in observe mode).
    Detectors then run on the N buffered steps at once. A float32 norm that overflowed (finite
    values, infinite norm) is told from a non-finite value by an extra read on the newest
    buffered step; older ones by what followed them (parameters finite at the newest step, or
    a finite loss at the next step: non-finite values never leave parameters). When the next
    step fails too, an older step's overflow stays reported as non-finite: the first
    non-finite step may then come one step early."""

    update_ratio_every: int = 10
    """Measure the update-to-parameter ratio ||dp|| / ||p|| every N steps (it needs a copy of the
    parameters before the step, so it is sampled). The copy's buffer is allocated once and kept:
    one extra copy of the parameters on their device — set 0 for models where that does not
    fit. 0 disables it."""

    sample_every: int = 10
    """Measure the sampled signals every N steps (`nanguard.watch.sampling`): the optimizer
    state's norms (momentum, Adam's moments; the `momentum_norm` the cascade and forecast
    detectors follow). They are also measured on every step of an alarm episode, on the step
    after each checkpoint save the guard sees, on a step whose parameters turned non-finite
    and at close. Every step, whatever N: the loss, the gradients' norms and finiteness, the
    parameters' and buffers' norms and finiteness after the update, the batch. 10 keeps the
    every-step cost near what `clip_grad_norm_` costs (BENCHMARKS.md); 1 measures the state
    every step. An `exp_avg_sq` that overflows to inf leaves the parameters finite (the
    update divides by its square root): it is reported at the next sampled step, or at
    close, not at the step it happened."""

    state_every: int = 10
    """Deprecated, kept so old configs load: the optimizer state follows `sample_every`."""

    activations: bool = False
    """Record per-module activation abs-max and headroom to the dtype's largest value."""

    activations_every: int = 1
    """When `activations` is on, measure on every N-th step only."""

    attention: bool = True
    """When `activations` is on, also measure the largest |attention logit| (softmax input of
    `F.scaled_dot_product_attention` or of a hand-written 4-d attention softmax, masked entries
    excluded) on the same steps (`nanguard.watch.attention`): a precursor of loss spikes in
    transformers. Costs a function mode over the sampled forwards; no cost on other steps."""

    per_parameter: bool = True
    """Store per-parameter gradient / parameter / optimizer-state norms in the run store."""

    quiet_lane: bool = True
    """Measure and read the common CPU step on the quiet lane (`watch.lane`: no packets, one
    host read). False sends every step through the packet path: the same statistics, alarms
    and record, more Python calls (the differential tests compare)."""


@_strict
@dataclass(kw_only=True)
class DetectConfig:
    """Thresholds of the detectors. Defaults never fire on the project's healthy runs."""

    warmup_steps: int = 20
    """Steps of history needed before the spike / cascade / divergence detectors may fire."""

    window: int = 100
    """Length of the recent history (healthy steps) the robust statistics are taken over."""

    spike_z: float = 5.0
    """Robust z-score (median / MAD of log10 grad norm) above which a step is a spike."""

    spike_ratio: float = 10.0
    """...and the grad norm must also be at least this many times the recent median."""

    spike_hard_ratio: float = 30.0
    """A grad norm this many times the recent median is a spike whatever its z-score."""

    spike_strong_z: float = 10.0
    """A grad norm or a loss this many robust standard deviations above its recent level is a
    spike from `spike_min_ratio` x that level on, well below `spike_ratio`. The level is the
    median of the last `spike_level_steps` healthy values and the deviation is taken from
    step-to-step changes (`detect.trend.trend_z`), so a slow trend (the initial descent,
    a growing grad norm) neither widens the yardstick nor shifts the level: a bad batch's loss
    at 1.6x its level is 20 sigma out where the loss's noise is a few %."""

    spike_min_ratio: float = 1.5
    """...and at least this many times its recent level (a one-step jump that matters)."""

    objective: str = "auto"
    """Is the loss a stationary series? `auto`: yes, unless the run shows otherwise (a rollout
    buffer refilled in its batches, an RL environment library loaded, another guard training
    another model: on-policy RL, a GAN; `nanguard.detect.objective`); then the loss-trend
    alarms (divergence, loss spikes) are off, and gradient, non-finite, cascade and forecast
    alarms keep watching. `stationary`: always on; `nonstationary`: off from the start."""

    spike_level_steps: int = 16
    """How many of the latest healthy values make a signal's recent level for
    `spike_strong_z`."""

    level_floor: float = 0.1
    """Spikes and cascades must also reach this fraction of the highest typical (median) level
    the signal has had in the run. Once a model has converged and its gradients have fallen by
    decades, their norm is heavy-tailed (rare hard samples dominate it): a 100x jump that stays
    far below the run's normal scale is one hard sample, not an instability."""

    early_spike_ratio: float = 20.0
    """Before `warmup_steps` of history (no statistics yet): a grad norm this many times the
    median of the healthy ones seen so far (and at least 3x the largest of them) is a spike.
    Healthy runs' gradients fall or wander in their first steps; a 20x jump over them is
    unmistakable."""

    early_growth: float = 30.0
    """Before `warmup_steps` of history: `cascade_steps` steps of growth that together multiply
    the signal by this much are a cascade (and may be forecast to overflow)."""

    early_loss_ratio: float = 10.0
    """Before the divergence statistics have history (`warmup_steps`): a loss at least this
    many times the run's first loss, two steps in a row, is an early divergence (a loss going
    4.5 -> 51 in its first steps). The reference is the loss's own initial scale, so a loss
    that fell far below it and wanders there (a GAN discriminator at 0.001) never fires."""

    saturation_every: int = 100
    """Arm the saturation probe (`nanguard.watch.saturation`) for one step every N steps: it
    notes sigmoid / softmax probabilities within rounding of exactly 0 or 1 that a `log`
    consumes (the NaN of a hand-written cross-entropy, waiting to happen) and raises a
    `saturation` warning. An armed step runs its ops through Python once; 0 disables it."""

    replica_every: int = 100
    """Under torch.distributed with replicated (DDP) parameters: after step 0 and every N steps,
    after the update, compare a bitwise fingerprint of every rank's parameters in one small
    all_gather (`nanguard.watch.replicas`); ranks that stop agreeing are a `replica_divergence`
    alarm naming the step, the ranks and the tensors (recorded, never acted on). The check
    turns itself off (one log line) where some rank has no Guard or the ranks are not replicas
    (sharded, tensor or pipeline parallel). On a GPU each check reads 3 numbers per rank back
    to the host, waiting for the queued work once per check (not once per step). 0 disables
    it."""

    cross_rank_rerun: bool = True
    """Under torch.distributed with `Guard(replay=...)` (or `nanguard run`) and a DDP model:
    when a rank's alarmed step re-runs (a spike, the first non-finite value), re-run that
    rank's batch on a peer rank too, to tell a faulty device (`persistent` on rank r) from a
    transient and from software or data (`nanguard.pinpoint.xrank`). The request rides the
    pre-step agreement the ranks make anyway under an acting policy; under `observe` it adds
    that agreement (one int32 all-reduce per step, as acting policies pay). False: each rank
    re-runs only its own batch."""

    rerun_every: int = 0
    """Opt-in silent-corruption check (`Guard(replay=...)` or `nanguard run` needed): re-run
    one quiet step every N steps before its update, from the same parameters, RNG states and
    batch, and compare its loss and gradients bit for bit (`nanguard.pinpoint.rerun`). A step
    that re-runs differently is a `rerun_mismatch` alarm with the verdict `transient` (a flipped
    bit or a non-deterministic kernel that left every value in range, which no detector of
    values can see). Costs one more forward and backward every N steps (N=1 doubles the step);
    alarmed steps are re-run anyway. 0 (default) disables it."""

    lead_window: int = 10
    """report.json's `first_warning` is the first alarm within this many steps before the first
    non-finite value (an unrelated spike long before does not count as a warning of it)."""

    cascade_steps: int = 3
    """Consecutive steps of multiplicative growth that make an amplification cascade."""

    cascade_growth: float = 1.5
    """Minimum growth factor per step counted towards a cascade."""

    cascade_ratio: float = 4.0
    """A cascade must also have taken the signal this many times above its recent median."""

    forecast_horizon: int = 10
    """Alarm when the extrapolated log-magnitude growth reaches the dtype's largest value within
    this many steps."""

    divergence_ratio: float = 3.0
    """Loss divergence: each of the last `divergence_steps` losses exceeds this multiple of the
    recent median loss (and their mean's robust z-score exceeds `spike_z`)."""

    divergence_steps: int = 5
    """Number of recent steps averaged by the loss-divergence detector."""

    vanishing_norm: float = 1e-10
    """Vanishing gradients: global grad norm below this multiple of the parameter norm..."""

    vanishing_steps: int = 20
    """...for this many consecutive steps."""

    cooldown: int = 50
    """Steps before the same (kind, signal) alarm may fire again (sustained conditions:
    cascade, forecast, divergence, vanishing)."""

    spike_cooldown: int = 5
    """Steps before another spike alarm may fire."""

    quiet_gate: bool = True
    """Let the quiet gate (`detect.gate`) take the steps no detector could alarm on, with the
    state updates alone. False runs every step through every detector: the same alarms and
    detector state, slower (the differential tests and `benchmarks/host_cost.py` compare)."""

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"unknown detect.objective {self.objective!r}; "
                             f"use one of: {', '.join(OBJECTIVES)}")


@_strict
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


@_strict
@dataclass(kw_only=True)
class RecoverConfig:
    """The `rollback` policy."""

    snapshot_every: int = 10
    """Take a snapshot of the last good state (host copy of what the optimizer trains, its
    state, buffers, RNG) every K quiet steps, into the ring (`snapshot_slots`). A capture costs
    about one step's time of copying on small models; every 10 steps is < 2% of step time on
    the benchmarks (BENCHMARKS.md, "Recovery")."""

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


@_strict
@dataclass(kw_only=True)
class ClipConfig:
    """Adaptive clipping: scale gradients down to mean + z * std of the recent grad norms."""

    z: float = 3.0
    """Threshold in standard deviations of the EMA of the grad norm."""

    ema: float = 0.02
    """EMA factor of the mean and variance."""

    warmup_steps: int = 25
    """Steps of statistics before clipping starts (a plain running mean meanwhile)."""


@_strict
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


@_strict
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


EARLY_WARNINGS = ("overflow", "spike", "cascade", "forecast")
"""The alarms that come before a cascade's first non-finite value."""


def default_act_on(policy: str) -> tuple[str, ...]:
    """What a policy acts on when `GuardConfig.act_on` is None."""
    return ("nonfinite", *EARLY_WARNINGS) if policy in ("skip", "rollback") else ("nonfinite",)


@_strict
@dataclass(kw_only=True)
class GuardConfig:
    """Everything a Guard can be told. `Guard(model, opt, policy="skip")` covers most uses."""

    policy: str = "observe"
    """What to do on an alarm: `observe` (change nothing), `raise` (stop with NanguardError
    carrying the report), `skip` (discard this step's update: parameters and optimizer state,
    step counters included, stay unchanged; what the forward pass itself changed — BatchNorm
    running statistics, random numbers drawn — stays changed), `rollback` (restore the last
    good state, buffers and RNG included, and go on with the next batches at a backed-off
    LR). With a GradScaler, a step whose gradients overflow is skipped by the scaler before
    the policy sees it."""

    act_on: tuple[str, ...] | None = None
    """Alarm kinds that trigger the policy; others are recorded and shown only. None: the
    policy's default (`default_act_on`): non-finite values only for `observe` and `raise`;
    for `skip` and `rollback` also the early warnings of a cascade (`overflow`, `spike`,
    `cascade`, `forecast`), so they act on the spike that starts it, not on the NaN six steps
    later. Healthy runs raise none of these at default thresholds."""

    watch: WatchConfig = field(default_factory=WatchConfig)
    """Measurement settings."""

    detect: DetectConfig = field(default_factory=DetectConfig)
    """Detector thresholds."""

    record: RecordConfig = field(default_factory=RecordConfig)
    """Run store settings."""

    recover: RecoverConfig = field(default_factory=RecoverConfig)
    """Rollback settings (policy `rollback`)."""

    clip: ClipConfig | None = None
    """Adaptive, NaN-safe gradient clipping; None (default) clips nothing."""

    amp: AmpConfig = field(default_factory=AmpConfig)
    """GradScaler thresholds."""

    heal: HealConfig = field(default_factory=HealConfig)
    """Precursor thresholds and cause correction (policy `heal`)."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def acting_on(self) -> tuple[str, ...]:
        """The alarm kinds the policy acts on: `act_on`, or the policy's default."""
        return self.act_on if self.act_on is not None else default_act_on(self.policy)

    def validate(self) -> None:
        """Raise ValueError with a one-line message for settings that cannot work (also run
        when the config is built, and again by the Guard after its keyword overrides)."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; use one of: {', '.join(POLICIES)}")
        if isinstance(self.act_on, str):
            raise ValueError(f"act_on must be a tuple of alarm kinds, got the string "
                             f"{self.act_on!r}; write act_on=({self.act_on!r},)")
        # Imported here: nanguard.detect's package imports its detectors, which import this
        # module, so a module-level import would be a circle.
        from nanguard.detect.alarm import ACT_ON_KINDS

        unknown = [k for k in self.act_on or () if k not in ACT_ON_KINDS]
        if unknown:
            raise ValueError(f"unknown alarm kind(s) in act_on: {', '.join(map(repr, unknown))}; "
                             f"valid: {', '.join(ACT_ON_KINDS)}")
        self.record.__post_init__()
        for name in ("read_every", "activations_every", "state_every", "sample_every"):
            if getattr(self.watch, name) < 1:
                raise ValueError(f"watch.{name} must be >= 1, got {getattr(self.watch, name)}")
        if self.watch.update_ratio_every < 0:
            raise ValueError("watch.update_ratio_every must be >= 0 (0 disables it)")
        r = self.recover
        if r.snapshot_every < 1 or r.max_rollbacks < 1 or not 0 < r.backoff_factor <= 1:
            raise ValueError(
                "recover: snapshot_every and max_rollbacks must be >= 1 and "
                "backoff_factor in (0, 1]"
            )
        if not 0 < r.backoff_min <= 1:
            raise ValueError(f"recover.backoff_min must be in (0, 1], got {r.backoff_min}")
        if self.detect.saturation_every < 0:
            raise ValueError("detect.saturation_every must be >= 0 (0 disables the probe), "
                             f"got {self.detect.saturation_every}")
        if self.detect.replica_every < 0:
            raise ValueError("detect.replica_every must be >= 0 (0 disables the check), "
                             f"got {self.detect.replica_every}")
        if self.detect.rerun_every < 0:
            raise ValueError("detect.rerun_every must be >= 0 (0 disables the check), "
                             f"got {self.detect.rerun_every}")
        if r.skip_escalation not in ("raise", "rollback"):
            raise ValueError(f"unknown recover.skip_escalation {r.skip_escalation!r}; "
                             "use one of: raise, rollback")
        h = self.heal
        if h.correct not in ("auto", "wd", "lr", "none"):
            raise ValueError(f"unknown heal.correct {h.correct!r}; use one of: auto, wd, lr, none")
        if not 0 < h.cut_factor < 1 or h.ratio <= 1 or h.correct_after < 1:
            raise ValueError("heal: cut_factor must be in (0, 1), ratio > 1, correct_after >= 1")
        if r.snapshot_slots < 1:
            raise ValueError(f"recover.snapshot_slots must be >= 1, got {r.snapshot_slots}")
        if r.snapshot_budget_mb is not None and not r.snapshot_budget_mb > 0:
            raise ValueError(f"recover.snapshot_budget_mb must be > 0 MiB (or None: no limit), "
                             f"got {r.snapshot_budget_mb}")
        if (self.policy != "observe" or self.clip is not None) and self.watch.read_every != 1:
            raise ValueError(
                f"policy {self.policy!r} decides every step, so watch.read_every must be 1"
            )
