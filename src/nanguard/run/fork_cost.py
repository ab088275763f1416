"""What a resume point costs the run (run/resume.py): the fork, and the copy-on-write page
faults the run pays for afterwards, so that points are spaced to a share of the run's time."""

from __future__ import annotations

import resource
import time

_AFTER = 3
"""Iterations after a fork that calibrate what one copy-on-write fault costs."""
_FAULT_S = 5e-6
"""What one such fault costs until calibrated (seconds): a first guess of the right order, to
be replaced by the run's own measurement."""


class ForkCost:
    """What the last point has cost the run so far, in seconds.

    A fork is paid for by the run itself: its first write to each page it now shares with a
    child copies that page (a minor page fault), in the iterations right after the fork and,
    for pages written rarely, long after. The bill is the fork itself plus the extra minor
    faults since (above the run's usual rate per iteration, measured while no fork was
    being paid for) times the time one costs, calibrated in the `_AFTER` iterations after
    each fork from their extra time over their extra faults.
    """

    def __init__(self) -> None:
        self.cost = 0.0
        self.calibrating = 0
        """Iterations after the last fork still calibrating the time of one fault."""
        self.usual = 0
        """Iterations that measured the run's own time and faults (no point before 3)."""
        self._fork_s = 0.0
        self._extra_faults = 0.0
        self._per_fault = _FAULT_S
        self._cal_s = self._cal_faults = 0.0
        self._period: float | None = None
        self._rate: float | None = None
        self._at: tuple[float, int] | None = None

    def forked(self, seconds: float) -> None:
        """A point was taken; the fork itself took `seconds`."""
        self._fork_s, self._extra_faults = seconds, 0.0
        self._cal_s = self._cal_faults = 0.0
        self.calibrating = _AFTER
        self.cost = seconds
        self._at = (time.monotonic(), _minor_faults())

    def iteration(self, now: float) -> None:
        """At each iteration (a backward outside an optimizer step)."""
        faults = _minor_faults()
        if self._at is not None:
            dt, df = now - self._at[0], faults - self._at[1]
            period = self._period if self._period is not None else dt
            rate = self._rate if self._rate is not None else float(df)
            extra = max(0.0, df - rate)
            if self.calibrating:
                self._cal_s += max(0.0, dt - period)
                self._cal_faults += extra
                self.calibrating -= 1
                if not self.calibrating and self._cal_faults >= 100:
                    self._per_fault = min(max(self._cal_s / self._cal_faults, 1e-7), 1e-4)
            elif not (self._fork_s and df > 1.5 * rate + 16):
                # A usual iteration (not one still copying pages): the run's own rates, down
                # at once, up slowly (the first iterations allocate the optimizer's state).
                self._period = _low(self._period, dt)
                self._rate = _low(self._rate, float(df))
                self.usual += 1
            self._extra_faults += extra
            if self._fork_s:
                self.cost = self._fork_s + self._extra_faults * self._per_fault
        self._at = (now, faults)


def _low(mean: float | None, value: float) -> float:
    return value if mean is None or value < mean else 0.9 * mean + 0.1 * value


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
