"""The finding's live line and the record's cause are one computation (`Events.finding`):
a line that leaves before the finding is complete says the cause follows; a held finding
(`nanguard run` until its re-run is done) leaves once, with the record's cause."""

from __future__ import annotations

import logging

import pytest

from nanguard.record.events import Event, Events
from nanguard.show.live import log_event

FIRST = {"step": 3, "phase": "loss", "op": None, "source": None, "samples": []}
LATER = {**FIRST, "phase": "forward", "op": "aten.acos", "source": "train.py:17"}
GUESS = {"cause": "exploding_init", "confidence": 0.3, "fix": "kaiming"}
RECORD = {"cause": "domain_error", "confidence": 0.9, "fix": "clamp to [-1, 1]"}


def _events(hold: bool, summary: bool = False) -> tuple[Events, list[Event]]:
    ev = Events(summary_follows=summary)
    if hold:
        ev.hold_findings()
    seen: list[Event] = []
    ev.add(seen.append)
    ev.add(log_event)
    return ev, seen


def test_a_finding_before_its_cause_says_the_cause_follows() -> None:
    ev, seen = _events(hold=False)
    ev.finding(FIRST, follows=True)
    ev.finding(LATER, RECORD)
    assert seen[0].message.endswith("; the cause follows") and seen[0].data["cause"] is None
    assert "; cause domain_error (90%); fix: clamp to [-1, 1]" in seen[1].message


@pytest.mark.parametrize("summary", [False, True])
def test_a_held_finding_leaves_once_then_with_the_record_cause(
        summary: bool, caplog: pytest.LogCaptureFixture) -> None:
    ev, seen = _events(hold=True, summary=summary)
    with caplog.at_level(logging.DEBUG, logger="nanguard"):
        ev.finding(FIRST, GUESS)  # the raise closed the guard: a guess from the phase alone
        ev.finding(LATER, RECORD)  # the re-run's origin, diagnosed again
        assert len(seen) == 1 and seen[0].message.endswith("; the cause follows")
        assert "exploding_init" not in caplog.text
        ev.release()
        ev.release()  # once
    assert len(seen) == 2 and seen[1].data["cause"] == RECORD and seen[1].notable is not summary
    assert "at train.py:17" in seen[1].message and "cause domain_error (90%)" in seen[1].message
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [m.message for m in seen if m.notable]
