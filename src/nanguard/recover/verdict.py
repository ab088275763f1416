"""Is the model back? The loss-level test behind the `recovered` status.

`recovered` must mean the model came back, not only that its loss is finite: after a skip or a
rollback, the median loss of the last 20 steps must be finite and within 2x of the median of
the 20 steps before the first non-finite value or the first action, whichever came first.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

RULE = ("median loss of the last 20 steps <= 2x the median of the 20 steps before the first "
        "non-finite value")


class LossWatch:
    """Keeps the loss level before the trouble and the level since, step by step."""

    def __init__(self, window: int = 20) -> None:
        self.recent: deque[float] = deque(maxlen=window)
        """Finite losses of updates that were kept, newest last (after the trouble: since)."""
        self.before: float | None = None
        """Their median when the first non-finite value or action came (None until then)."""

    def observe(self, loss: float | None, skipped: bool, troubled: bool) -> None:
        """Runs once per recorded step. `troubled`: a non-finite value was found or the policy
        acted, at this step or before."""
        if troubled and self.before is None and self.recent:
            self.before = statistics.median(self.recent)
            self.recent.clear()  # from here on: the losses after the failure
        if loss is not None and math.isfinite(loss) and not skipped:
            self.recent.append(loss)

    def verdict(self) -> dict[str, Any]:
        """`loss_before`, `loss_end`, `back` (True / False; None when there is no loss to
        compare with) and the rule."""
        before = self.before
        after = statistics.median(self.recent) if self.recent else None
        back: bool | None
        if before is None or after is None:
            back = None if before is None and after is not None else (False if after is None
                                                                      else None)
        else:
            back = after <= before + max(abs(before), 1e-8)  # 2x for positive losses
        return {"loss_before": before, "loss_end": after, "back": back, "rule": RULE}
