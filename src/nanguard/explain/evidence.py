"""What the diagnosis rules look at, gathered once from the report and the training context."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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

    def warnings_before(self, kinds: tuple[str, ...]) -> list[dict[str, Any]]:
        """Alarms of these kinds within `lead_window` steps before the first non-finite value
        (or anywhere, on a run that never went non-finite)."""
        step = self.step
        return [
            a
            for a in self.alarms
            if a["kind"] in kinds and (step is None or step - self.lead_window <= a["step"] <= step)
        ]
