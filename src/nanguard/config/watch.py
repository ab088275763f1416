"""`WatchConfig`: what a Guard measures each step, what it samples, and how often it reads."""

from __future__ import annotations

from dataclasses import dataclass

from nanguard.config.strict import strict


@strict
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
