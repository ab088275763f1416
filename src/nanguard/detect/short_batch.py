"""A short batch's gradient: noisier by its size, not by a fault.

The gradient of a step is a mean over its batch's samples: with fewer samples its noise grows
as 1/sqrt(samples). The last batch of an epoch is often short (a `DataLoader` without
`drop_last`, a language model's last `bptt` window: pytorch/examples' word_language_model
ends every epoch with a batch of 9 rows where the others hold 35, and its grad norm is 1.9-2x
theirs, every epoch, on clean data: sqrt(35 / 9) = 1.97). Judged as it is, that step is a
"spike" at 11-16 sigma, an alarm and a wrong explanation (an optimizer divergence) on a
healthy run. The spike detector judges such a step's grad norm scaled by
sqrt(rows / usual rows) (`noise_scale`): the norm a full batch of the same noise would have.
At most that factor: a signal-dominated gradient grows less, so a real spike on a short batch
is still one (by less than the factor), and a full batch is never scaled.
"""

from __future__ import annotations

import math
from typing import Any


def batch_rows(stats: Any) -> int:
    """Samples of the batch (all micro-batches) the guard was handed for step `stats`; 0 when
    unknown. Read from the fingerprints as kept (their sizes when still raw): no host read,
    no combining."""
    kept = stats.raw_hashes()
    if type(kept) is tuple:  # (per-tensor sums, tensors per sample, samples per micro-batch)
        return int(sum(kept[2]))
    return len(kept)


def noise_scale(rows: int, usual: int) -> float:
    """The factor that brings a batch of `rows` samples' grad norm to the noise of the run's
    `usual` batch: sqrt(rows / usual) below it, 1 otherwise (or when either is unknown)."""
    if rows <= 0 or usual <= 0 or rows >= usual:
        return 1.0
    return math.sqrt(rows / usual)
