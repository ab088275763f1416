"""What `nanguard run` tells the person once the script is done, and the exit code it returns.

`ScriptOutcome` is how the script ended (run/run_script.py sets it while the script
unwinds). After the run folder is written (run/runner.py), the summary is printed
(rank 0 only), then one line each for what could not be watched, a re-run that could not
pinpoint the origin, how the script ended and why nothing was watched; `exit_code` picks the
code: the script's own non-zero code, or its own error, wins; else 1 when the status is not
one a CI gate may pass (`OK_STATUSES`) or `raise` stopped training, else 0. `say` is the one
way the runner speaks on stderr (`nanguard run: ...`). Nothing here runs while the script
trains.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nanguard.record.report import OK_STATUSES, Report
from nanguard.run.discovery import Discovery
from nanguard.run.watched import Watched

# OK_STATUSES (record.report's: the statuses a CI gate passes) is re-exported for runner.py.
__all__ = ["OK_STATUSES", "ScriptOutcome", "exit_code", "print_outcome", "print_run_summary",
           "say"]


@dataclass
class ScriptOutcome:
    """How the script ended."""

    kind: str = "ok"
    """`ok`, `exit` (SystemExit with a non-zero code), `error` (an exception of its own),
    `stopped` (nanguard's `raise` policy), `internal` (an error inside nanguard's own hooks),
    `interrupted` (SIGINT, SIGTERM) or `preflight` (`--preflight-only` stopped it)."""
    code: int = 0
    message: str | None = None
    evidence: dict[str, Any] | None = None
    """A non-finite value the script held when it ended that no guarded step recorded (see
    `Discovery.nonfinite_evidence`)."""
    hard_exit: bool = False
    """The script ended with `os._exit(code)` (its main thread): nanguard's epilogue ran
    first, and the `nanguard run` command then exits the same hard way."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"outcome": self.kind, "exit_code": self.code,
                               "message": self.message}
        if self.hard_exit:
            out["os_exit"] = True
        if self.evidence:
            out["nonfinite_before_end"] = self.evidence["signals"]
        return out

    @property
    def ended(self) -> str:
        """How the training ended, in the Guard's words (`Guard.close(ended=...)`)."""
        if self.kind == "interrupted":
            return "interrupted"
        return "error" if self.kind in ("exit", "error", "internal") else "ok"


def say(line: str, prefix: str = "") -> None:
    """Print one line of the runner's own to stderr (`nanguard run: ...`)."""
    print(f"nanguard run: {prefix}{line}", file=sys.stderr)


def print_run_summary(report: Report, disc: Discovery, target: Watched | None) -> None:
    """The closing summary (show/summary.py) with the failing part's history, or each
    part's when several optimizers were watched."""
    from nanguard.show.summary import parts_shown, print_summary

    history = target.guard.history if target is not None and target.guard is not None else []
    parts: dict[str, Any] = {}
    if len(disc.watched) > 1:
        watched = {w.name: w.guard.history for w in disc.watched if w.guard is not None}
        shown = parts_shown(report.run, list(watched), target.name if target else None)
        parts = {name: watched[name] for name in shown}
    elif not history and len(disc.watched) == 1 and disc.watched[0].guard is not None:
        history = disc.watched[0].guard.history
    sys.stdout.flush()
    print_summary(report, history, parts_history=parts or None)


def print_outcome(outcome: ScriptOutcome, script: Path, replay: dict[str, Any] | None,
                   prefix: str = "", *, report: Report | None = None,
                   disc: Discovery | None = None) -> None:
    if disc is not None:
        for w in disc.watched:
            if w.note:
                say(w.note, prefix=prefix)
            if w.error:
                say(f"could not watch {w.name} ({type(w.optimizer).__name__}): {w.error}",
                     prefix=prefix)
    if replay is not None and replay.get("status") == "budget_exhausted":
        say(f"the re-run to pinpoint the origin ran out of its budget "
             f"(--replay-budget {replay['budget_s']:g} s); the finding above is from the "
             "watched signals only", prefix=prefix)
    elif replay is not None and replay.get("status") in ("error", "not_reproduced"):
        say(f"the re-run could not pinpoint the origin: {replay.get('reason')}", prefix=prefix)
    numerical = report is not None and report.first_nonfinite is not None
    if outcome.kind == "exit":
        runaway = _runaway(report)
        why = ("after non-finite values appeared: see above" if numerical else
               f"after nanguard found the numbers running away ({runaway}: see above)"
               if runaway else "not a nanguard failure")
        say(f"{script.name} exited with code {outcome.code} (the script's own exit, {why})",
            prefix=prefix)
    elif outcome.kind == "error" and numerical:
        say(f"{script.name} failed with an error after non-finite values appeared: a "
             f"numerical failure (see above): {outcome.message}", prefix=prefix)
    elif outcome.kind == "error":
        say(error_text(script.name, outcome.message or "", report), prefix=prefix)
    elif outcome.kind == "internal":
        say(f"nanguard itself failed while {script.name} ran (a nanguard bug, please report "
             f"it): {outcome.message}", prefix=prefix)
    elif outcome.kind == "stopped":
        say(f"training stopped by the raise policy: {outcome.message}", prefix=prefix)
    elif outcome.kind == "interrupted":
        say(f"{script.name} was interrupted ({outcome.message}); the record holds every "
             "step up to then", prefix=prefix)
    if report is not None and report.status == "unwatched":
        say(_unwatched_reason(disc), prefix=prefix)


RUNAWAY_KINDS = ("overflow", "cascade", "forecast", "divergence")
"""Alarms that say the numbers were running away (not a spike, which may heal): an error the
script raised after one followed from them."""

_NUMERIC_ERRORS = ("OverflowError", "ZeroDivisionError", "FloatingPointError")
_NUMERIC_VALUE_ERRORS = ("math domain error", "cannot convert float nan",
                         "cannot convert float infinity", "out of range float")


def numeric_error(message: str) -> bool:
    """`message` (`Type: text`, as `ScriptOutcome` keeps it) is an error of arithmetic on
    numbers: an overflow (`math.exp` of a huge loss), a division by zero, a domain error
    (`math.log` of a negative), a NaN or inf made an integer."""
    name, _, text = message.partition(": ")
    return name in _NUMERIC_ERRORS or (
        name == "ValueError" and any(t in text.lower() for t in _NUMERIC_VALUE_ERRORS))


def _runaway(report: Report | None) -> str | None:
    """nanguard's first finding that the numbers were running away, in words (`divergence
    at step 3, cause optimizer_divergence`), or None."""
    if report is None:
        return None
    first = next((a for a in report.alarms if a["kind"] in RUNAWAY_KINDS), None)
    if first is None:
        return None
    causes = [d["cause"] for d in report.diagnosis if d.get("cause") != "undetermined"]
    return f"{first['kind']} at step {first['step']}" + (f", cause {causes[0]}" if causes
                                                          else "")


def error_text(name: str, message: str, report: Report | None) -> str:
    """The script's own error, when no non-finite value was recorded: an arithmetic one that
    came after nanguard found the numbers running away followed from them (word_language_model
    at `--lr 1000`: `math.exp(cur_loss)` overflows after the divergence alarm); another error
    after it is named beside the finding, not blamed on it; an arithmetic error says so even
    without one."""
    runaway = _runaway(report)
    if runaway is not None and numeric_error(message):
        return (f"{name} failed with an arithmetic error that followed from the numbers: "
                f"nanguard found them running away first ({runaway}: see above): {message}")
    if runaway is not None:  # (a KeyError does not follow from a divergence: not claimed)
        return (f"{name} failed with its own error, after nanguard found the numbers running "
                f"away ({runaway}: see above): {message}")
    if numeric_error(message):
        return (f"{name} failed with an arithmetic error of its own: {message}; the steps "
                "nanguard watched held no non-finite value and no divergence before it, so "
                "look at the values that line computes (a loss, a count, a log of one)")
    return f"{name} failed with its own error, not a numerical one: {message}"


def _unwatched_reason(disc: Discovery | None) -> str:
    started = disc.processes_started if disc is not None else 0
    if started:
        return (f"nothing was watched: no optimizer stepped and no backward ran in this "
                f"process, and it started {started} worker process(es); training inside "
                "worker processes (torch.multiprocessing, Hogwild) is not watched")
    return ("nothing was watched: the script ran no optimizer step and no backward() in "
            "this process")


def exit_code(outcome: ScriptOutcome, report: Report) -> int:
    """The script's own non-zero code wins; else 1 unless the status is one a CI gate may
    pass (`healthy`, `warned`, `recovered`)."""
    if outcome.kind in ("exit", "error", "interrupted", "internal"):
        return outcome.code
    if outcome.kind == "stopped" or report.status not in OK_STATUSES:
        return 1
    return 0
