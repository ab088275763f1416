"""What the diagnosis rules look at, gathered once from the report and the training context."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from nanguard.record.lead import lead_in


@dataclass(kw_only=True)
class Cause:
    """One ranked explanation: a name from the cause vocabulary, how sure, why, what to change."""

    cause: str
    confidence: float
    evidence: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class Evidence:
    """Everything a rule may read. Fields are optional: a rule says what it needs."""

    first_nonfinite: dict[str, Any] | None = None
    """report.json's `first_nonfinite` (phase, module, op, samples, signals, inputs, ...)."""
    alarms: list[dict[str, Any]] = field(default_factory=list)
    """All alarms of the run, in step order."""
    optimizer: str | None = None
    """Optimizer class name, e.g. `SGD`, `AdamW`."""
    lr: float | None = None
    momentum: float | None = None
    """SGD momentum or Adam beta1."""
    eps: float | None = None
    """Adam-family eps."""
    weight_decay: float | None = None
    """The largest `weight_decay` of the optimizer's parameter groups."""
    decoupled_decay: bool = False
    """Whether that decay multiplies the weights by (1 - lr * weight_decay) each step (AdamW,
    Lion, SGD's L2 term, Adam with `decoupled_weight_decay`), not through an adaptive
    normalisation (Adam's L2 term)."""
    dtype: str | None = None
    """Parameter / autocast dtype, e.g. `torch.float16`."""
    healthy_grad_norm: float | None = None
    """Median grad norm of the healthy history (for a clipping threshold)."""
    bad_tensors: list[int] = field(default_factory=list)
    """Indices of the batch tensors (inputs first, targets last) holding non-finite samples."""
    n_batch_tensors: int = 0
    reproduced: bool | None = None
    """Whether an op-level replay reproduced the failure bit for bit."""
    lead_window: int = 10
    history: list[dict[str, Any]] = field(default_factory=list)
    """The steps the guard kept up to (and just after) the failure, oldest first: `step`,
    `loss`, `grad_norm` (global), `act_max` (largest finite activation abs-max, None when
    activations were not watched) and `lr`; NaN/Inf kept as floats."""
    clip: float | None = None
    """The `max_norm` the script's own gradient clipping uses (0: clipping off), when known."""
    argv: list[str] | None = None
    """The training script's command line (`sys.argv[1:]`, `Guard.script_argv`); a fix that
    changes a value one of its flags set names that flag (`explain.fixes.find_flag`). None:
    unknown."""
    entry: str = "api"
    """How nanguard was started: `api` (a `Guard` in the user's code) or `run` (zero code,
    `nanguard run SCRIPT`); fixes name the matching knob."""
    loaded: bool | None = None
    """Whether state was loaded (`torch.load`, `load_state_dict`): True seen, False none in the
    whole script (`nanguard run` tracks every call), None unknown (a `Guard` created after a
    load cannot know). The event `checkpoint_nonfinite` needs."""
    reruns: list[dict[str, Any]] = field(default_factory=list)
    """Re-execution verdicts of alarmed steps (`pinpoint.rerun`), oldest first: `step`,
    `source` (`spike`: the spike re-run, `spikes[].rerun`; `nonfinite`: the first non-finite
    step's replay), `verdict` (`reproducible` / `transient` / `persistent`), and when known
    `loss_same`, `differing` (gradients that differed), `deterministic_algorithms`, `device`,
    `why`; after a cross-rank re-run (`pinpoint.xrank`) the verdict is the one every rank
    agreed, with `rank` (the rank whose batch was re-run: the faulty one when `persistent`),
    `cross_rank` (`rank`, `peer`, `loss_same`, `grads_same`, `why`) and `local_verdict` (this
    rank's own re-run's)."""
    actions: list[dict[str, Any]] = field(default_factory=list)
    """What a recovery policy did during the run (`step`, `action`, `detail`; report.json
    `actions`): a fix does not propose the recovery that already ran, and after `heal`'s LR
    cuts it starts from the LR the run ended at."""
    preflight: dict[str, Any] | None = None
    """The preflight's verdict when one ran before training (`nanguard run --preflight`,
    report.json `run.preflight`): `findings` (`code`, `severity`, `location`, `details`),
    `layers` (`name`, `std`, `ratio` = std * sqrt(fan_in)), `lr_probe` (`diverge_lr`,
    `suggested_lr`), `overfit` (`first_loss`: the untrained model's loss on the first batch)."""

    @property
    def op(self) -> str:
        return str((self.first_nonfinite or {}).get("op") or "")

    @property
    def phase(self) -> str:
        return str((self.first_nonfinite or {}).get("phase") or "")

    @property
    def step(self) -> int | None:
        return None if self.first_nonfinite is None else self.first_nonfinite.get("step")

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """Ranges of the origin op's inputs, when the op checker recorded them."""
        return list((self.first_nonfinite or {}).get("inputs") or [])

    @property
    def magnitude(self) -> float | None:
        """Largest finite |value| among the origin op's inputs; None without input ranges."""
        top: float | None = None
        for i in self.inputs:
            for key in ("min", "max"):
                v = _num(i.get(key))
                if v is not None and math.isfinite(v):
                    top = abs(v) if top is None else max(top, abs(v))
        return top

    def steps_until_failure(self) -> list[dict[str, Any]]:
        """`history` entries up to the failing step (all of them on a run that never failed)."""
        step = self.step
        return [h for h in self.history if step is None or h.get("step", 0) <= step]

    def lead_start(self) -> int | None:
        """Where the trouble that ended in the first non-finite value began: the first of the
        warnings that led into it (`lead_in`, report.json's `first_warning`), or `lead_window`
        steps before it if that is earlier; None on a run that never went non-finite."""
        step = self.step
        if step is None:
            return None
        first = lead_in([a["step"] for a in self.alarms if a["kind"] != "nonfinite"], step,
                        self.lead_window)
        return step - self.lead_window if first is None else min(first, step - self.lead_window)

    def cascade_verdict(self) -> dict[str, Any] | None:
        """The verdict of the step the trouble began with: the earliest re-run verdict from
        `lead_start` to the first non-finite value (any, on a run that never went
        non-finite). A cascade that began with a transient (a flipped bit, a racing kernel) is
        the fault's, whatever the optimizer made of it afterwards."""
        step, start = self.step, self.lead_start()
        for r in self.reruns:
            if r.get("verdict") and (step is None or start is None or start <= r["step"] <= step):
                return r
        return None

    def warnings_before(self, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
        """Alarms of these kinds from `lead_start` to the first non-finite value (or
        anywhere, on a run that never went non-finite): the warnings of this failure."""
        step, start = self.step, self.lead_start()
        return [
            a
            for a in self.alarms
            if a["kind"] in kinds and (step is None or start is None or start <= a["step"] <= step)
        ]


def _num(v: object) -> float | None:
    """A number from report JSON (floats, or the strings "nan" / "inf" / "-inf"); else None."""
    if isinstance(v, bool) or v is None:
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
