"""`GuardConfig`: everything a Guard can be told, the sections nested, and the checks that
refuse settings which cannot work together."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanguard.config.detect import DetectConfig
from nanguard.config.record import RecordConfig
from nanguard.config.recover import AmpConfig, ClipConfig, HealConfig, RecoverConfig
from nanguard.config.strict import strict
from nanguard.config.watch import WatchConfig

POLICIES = ("observe", "raise", "skip", "rollback", "heal")
"""`GuardConfig.policy`: what a Guard may do on an alarm."""

EARLY_WARNINGS = ("overflow", "spike", "cascade", "forecast")
"""The alarms that come before a cascade's first non-finite value."""


def default_act_on(policy: str) -> tuple[str, ...]:
    """What a policy acts on when `GuardConfig.act_on` is None."""
    return ("nonfinite", *EARLY_WARNINGS) if policy in ("skip", "rollback") else ("nonfinite",)


@strict
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
