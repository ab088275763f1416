"""Which warnings belong to a failure: the run of alarms that led into it.

Shared by report.json's `first_warning` (`record.report`) and the diagnosis's evidence
(`explain.evidence`), so the summary's "first warning at step N" and a cause's "alarms from
step N" are one computation.
"""

from __future__ import annotations

__all__ = ["lead_in"]


def lead_in(warnings: list[int], failure: int, window: int) -> int | None:
    """The first warning of a failure at step `failure`: the first of the run of warnings
    (steps of alarms) that led into it, walking back from the failure while each warning
    comes no more than `window` steps before the next one (or the failure). Warnings that
    kept coming from step 2 to a NaN at step 18 all belong to it; a spike long before, with
    quiet steps between, does not. None when no warning came within `window` steps.

    An alarm at the failure's own step is no warning of it: it came with the non-finite
    value (BatchNorm's running statistics holding the batch's NaN, a spike judged in the same
    step), so it gives the person no step to act in and is not counted."""
    first = None
    edge = failure
    for s in sorted({s for s in warnings if s < failure}, reverse=True):
        if edge - s > window:
            break
        first = edge = s
    return first
