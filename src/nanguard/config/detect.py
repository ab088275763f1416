"""`DetectConfig`: the detectors' thresholds, windows and cooldowns, and the opt-in checks
(saturation probe, replica fingerprints, silent-corruption re-runs) they schedule."""

from __future__ import annotations

from dataclasses import dataclass

from nanguard.config.strict import strict

OBJECTIVES = ("auto", "stationary", "nonstationary")
"""`DetectConfig.objective`: is the loss a stationary series (`nanguard.detect.objective`)."""


@strict
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

    loss_spike_min_ratio: float = 1.1
    """The loss's own `spike_min_ratio`. A loss is a mean over the batch's samples with a noise
    of a few %, so a batch whose loss is 1.1x its level at `spike_strong_z` sigma stands out
    as its gradient's 1.5x does: word_language_model's first-epoch bad batches, near the
    model's unigram plateau, sit at 1.13-1.35x and 12-21 sigma, and no clean step of those
    runs reaches 10 sigma."""

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
    """report.json's `first_warning` is the first of the alarms that led into the first
    non-finite value, each within this many steps of the next (warnings that kept coming from
    the start count; an unrelated spike long before, with quiet steps between, does not)."""

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
