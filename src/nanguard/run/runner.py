"""Zero-code mode: run an unmodified training script under nanguard (`nanguard run`).

The script runs in this process as `__main__` (`runpy.run_path`, `sys.argv` rewritten,
`sys.path[0]` = the script's folder, as `python -m cProfile` does) while `Discovery` attaches a
guard to every optimizer that steps. When the script is done:

1. each guard is closed with how the script ended (`ok`, `error`, `interrupted`: one run
   folder per optimizer: DIR itself when there is one, else DIR/optimizer-N plus a merged
   DIR/report.json; under torchrun DIR/rank-R/ per rank). A script that ended (by an error, or
   on its own) right after a non-finite value no guarded step recorded (the loss of its last
   backward, the output of its last training forward: BCE's "all elements of input should be
   between 0 and 1", `torch.multinomial`'s "probability tensor contains either inf, nan or
   element < 0") gets that value as its finding: status `failed`, pinpointed like any other;
2. on a non-finite value, the origin op comes first from the guard's in-process replay:
   `Discovery` records each step's model call and loss by reference (pinpoint/recorded.py) and
   the guard replays the failing step under the op checker before its update, so a failure
   hours into a run is pinpointed where it happens (report `run.replay.status`: `in-process`).
   When that step cannot be replayed in process (the reason goes to `run.replay.in_process`:
   an unrecognised loss, a model called several times per step, a closure optimizer, ...) or
   the value came from the batch (phase `data`), the step is run again with
   `pinpoint.armed(step)` within `replay_budget` seconds: from the newest resume point before
   it (run/resume.py: a fork of the run taken every `fork_every` seconds while it was
   healthy), else the script from its start, deterministically, in a subprocess (single
   process; same initial RNG states). Its origin refines `first_nonfinite` and the diagnosis
   is redone;
3. under torchrun, rank 0 merges the ranks' reports from their files (never through the
   process group, so a dead rank cannot hang it);
4. the summary is printed (rank 0 only) and the exit code chosen: the script's own non-zero
   code, or an error of the script itself, wins (with a line saying what it was); else 1 when
   the status is not `healthy`, `warned` or `recovered` (`failed`, `crashed`, `unwatched`,
   `degraded`, `interrupted`) or `raise` stopped training, else 0;
5. an error inside this epilogue (nanguard's, not the script's) fails open like any hook: one
   line, the traceback in DIR/nanguard_error.txt, and report.json from what the guards
   recorded (`failed` if a non-finite value was seen, else `degraded`), never a traceback
   instead of a report.

With `--preflight` (`preflight=True`), the script's first optimizer step first runs the
preflight (audit/preflight_live.py) on copies of its model, optimizer and batch: the verdict is
printed then, set on every guard (the diagnosis reads it) and written to report.json under
`run.preflight`; training goes on untouched. `--preflight-only` stops the script there: the
report (status `unwatched`: nothing was trained) holds the verdict, and the exit code is 1 for an
error-level finding, 0 for none, 2 when the preflight could not run (it says why).

While the script runs, SIGTERM (a scheduler's time limit, `timeout`) raises `Terminated`, a
`KeyboardInterrupt`, in the main thread: the script unwinds as on Ctrl-C and the run is
written with status `interrupted` (or `failed` when a non-finite value came first); the
previous handler is restored afterwards. Every global hook and patch is removed in `finally`,
and `sys.argv` / `sys.path` restored.

The parts, each in its own module: run/run_script.py runs the script and tells how it
ended; run/run_reports.py settles and closes the guards and writes the run folder;
run/rerun.py is the pinpointing re-run; run/run_output.py prints the summary
and chooses the exit code. This module holds what `nanguard run` was asked (`RunOptions`), the
order in which the parts run (`run`), the `--preflight-only` ending and the fail-open epilogue.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nanguard.audit.preflight_live import LivePreflight, verdict_lines
from nanguard.config import DetectConfig, GuardConfig, RecordConfig, WatchConfig
from nanguard.record.merge import collect_rank_reports, merge_reports
from nanguard.record.report import Report
from nanguard.run.discovery import Discovery
from nanguard.run.rerun import go_on, release_findings, rerun_step, seen_nonfinite
from nanguard.run.resume import ResumePoints
from nanguard.run.run_output import (
    OK_STATUSES,
    ScriptOutcome,
    exit_code,
    print_outcome,
    print_run_summary,
    say,
)
from nanguard.run.run_reports import (
    close_guards,
    default_out,
    failing_step,
    first_failure,
    found_in_process,
    late_finding,
    refine,
    set_finding,
    settle_in_process,
    world,
    write_folder,
)
from nanguard.run.run_script import run_script
from nanguard.show.progress import waiting
from nanguard.watch import rng


@dataclass(kw_only=True)
class RunOptions:
    """What `nanguard run` was asked to do."""

    script: str
    args: list[str] = field(default_factory=list)
    out: str | None = None
    """Run folder; None picks `nanguard_runs/<time>` (under torchrun: `torchrun-<run id>`)."""
    policy: str = "observe"
    replay_budget: float = 120.0
    """Seconds the pinpointing re-run may take; 0 turns it off."""
    fork_every: float = 30.0
    """Seconds between resume points (run/resume.py: forks of the run that the
    re-run starts from instead of the script's start); 0 turns them off."""
    merge_wait: float = 30.0
    """Under torchrun: seconds rank 0 waits for the other ranks' reports before merging."""
    activations_every: int = 10
    """Per-module activation abs-max every N steps (0: off): the headroom to the dtype's
    limit and the forecast of an overflow, cheaply (hooks return at once between samples)."""
    rerun_every: int = 0
    """`DetectConfig.rerun_every`: re-run one quiet step every N steps and compare bit for
    bit (0: off)."""
    objective: str = "auto"
    """`DetectConfig.objective`: is the loss a stationary series (`detect.objective`)."""
    summary: bool = True
    preflight: bool = False
    """Run the preflight at the script's first optimizer step, then train on."""
    preflight_only: bool = False
    """Run the preflight, then stop (exit 1 on an error-level finding, 2 if it could not run)."""
    exit_hard: bool = False
    """When the script ended by `os._exit` (to skip the interpreter's teardown), end this
    process the same way once the record is written and the summary printed (the `nanguard
    run` command sets it; an in-process caller gets the exit code back)."""


def run(opts: RunOptions) -> int:
    """Run the script; see the module docstring. Returns the exit code."""
    script = Path(opts.script)
    if not script.is_file():
        raise ValueError(f"no such script: {opts.script!r}")
    rank, world_size = world()
    out = Path(opts.out) if opts.out else default_out(world_size)
    folder = out / f"rank-{rank}" if world_size > 1 else out
    folder.mkdir(parents=True, exist_ok=True)

    live: LivePreflight | None = None
    if opts.preflight or opts.preflight_only:
        live = LivePreflight(only=opts.preflight_only)
        if world_size > 1:  # a DDP model cannot be copied off its process group
            live.not_run("under torch.distributed the preflight is skipped; run it in one "
                         "process: nanguard run --preflight-only SCRIPT ARGS")
    disc = Discovery(lambda i: folder / f"optimizer-{i}", policy=opts.policy,
                     config=GuardConfig(
                         record=RecordConfig(summary=False),
                         detect=DetectConfig(rerun_every=opts.rerun_every,
                                                     objective=opts.objective),
                         watch=WatchConfig(activations=opts.activations_every > 0,
                                           activations_every=max(1, opts.activations_every))),
                     preflight=live if live is not None and not live.done else None)
    initial_rng = rng.capture()
    points = ResumePoints(opts.fork_every if world_size == 1 else 0.0,
                          failed=lambda: seen_nonfinite(disc),
                          go=lambda point, message: go_on(disc, point, message))
    disc.resume = points
    outcome = run_script(script, opts.args, disc)
    if live is not None and live.result is None:
        live.not_run(_preflight_missed(outcome))
        if opts.summary:
            for line in verdict_lines(live.result or {}, only=opts.preflight_only):
                print(line, file=sys.stderr)
    if opts.preflight_only:
        points.close()
        return _preflight_only(disc, outcome, live, folder)

    try:
        code = _finish(opts, script, out, folder, disc, outcome, points, live, initial_rng)
    except Exception as exc:  # noqa: BLE001 - fail open: the run still ends with a report
        points.close()
        code = _finish_failed(folder, disc, outcome, exc, summary=opts.summary)
    if opts.exit_hard and outcome.hard_exit:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # what the script asked for: no interpreter teardown
    return code


def _finish(opts: RunOptions, script: Path, out: Path, folder: Path, disc: Discovery,
            outcome: ScriptOutcome, points: ResumePoints, live: LivePreflight | None,
            initial_rng: dict[str, Any]) -> int:
    """After the script: settle and close the guards, pinpoint by a re-run when needed, write
    the run folder (merged under torchrun), print the summary; returns the exit code."""
    rank, world_size = world()
    late = late_finding(disc, outcome, rank)
    for w in disc.watched:
        if w.guard is not None:  # the closing summary below prints the finding
            w.guard.events.expect_summary(opts.summary)
        settle_in_process(w)
    reports = close_guards(disc, outcome)
    if late is not None:
        w, finding = late
        reports[w.index] = set_finding(w, finding)
    disc.release()
    replay: dict[str, Any] | None = None
    target = first_failure(disc.watched, reports)
    if target is not None:
        if found_in_process(target):
            replay = {"status": "in-process", "step": failing_step(target)}
        elif world_size > 1:
            replay = {"status": "skipped", "reason": "torch.distributed: one rank cannot re-run "
                      "a multi-rank script; the watched signals name the rank and batch"}
        elif opts.replay_budget <= 0:
            replay = {"status": "skipped", "reason": "--replay-budget 0"}
        elif outcome.kind == "interrupted":
            replay = {"status": "skipped", "reason": "interrupted: no time for a re-run"}
        elif (target.guard is not None and target.guard.first_nonfinite is not None
              and target.guard.first_nonfinite.get("phase") == "checkpoint"):
            # No op produced the value: it was loaded. The guard named the tensors and the
            # load line; a re-run could only blame the first op that read it.
            replay = {"status": "skipped", "reason": "the non-finite value was loaded "
                      "(phase checkpoint): no op produced it"}
        else:
            late_step = disc.steps_started if late is not None and late[0] is target else None
            assert target.guard is not None and target.guard.first_nonfinite is not None
            with waiting(f"re-running step {target.guard.first_nonfinite['step']} under the "
                         "op checker to pinpoint where the first non-finite value came from "
                         f"(--replay-budget {opts.replay_budget:g} s)"):
                replay = rerun_step(script, opts.args, target, initial_rng, opts.replay_budget,
                                 global_step=late_step, points=points)
            if replay.get("origin"):
                reports[target.index] = refine(target, replay["origin"])
        if replay["status"] != "in-process" and target.in_process:
            replay["in_process"] = target.in_process.get("reason")
        reports[target.index].run["replay"] = {k: v for k, v in replay.items() if k != "origin"}
    release_findings(disc)
    # The points left are of no more use (were this to raise first, each would quit when
    # this process is gone: its pipe closes).
    points.close()

    report = write_folder(folder, disc.watched, reports, outcome, replay,
                    preflight=live.result if live is not None else None,
                    internal_error=disc.error,
                    resume=points.summary() if opts.fork_every > 0 and world_size == 1 else None)
    if world_size > 1:
        if rank != 0:
            if opts.summary:
                print_outcome(outcome, script, None, prefix=f"rank {rank}: ", report=report,
                               disc=disc)
            return exit_code(outcome, report)
        parts, missing = collect_rank_reports(out, world_size, opts.merge_wait)
        report = merge_reports(parts, {"folder": str(out), "world_size": world_size,
                                       "missing_ranks": missing, "script": outcome.to_dict()})
        report.write(out)
        if missing:
            say(f"no report from rank(s) {missing} within {opts.merge_wait:g} s; merged the rest")
    if opts.summary:
        print_run_summary(report, disc, target)
        print_outcome(outcome, script, replay, report=report, disc=disc)
    return exit_code(outcome, report)


def _finish_failed(folder: Path, disc: Discovery, outcome: ScriptOutcome, exc: Exception, *,
                   summary: bool) -> int:
    """An error inside nanguard's own epilogue (settling, closing, re-running, merging): the
    script has ended already, so fail open here too: say so once, keep the traceback in the
    run folder and write report.json from what the guards recorded (each guard's report as
    it stands; the earliest finding wins). A run that had seen a non-finite value stays
    `failed`; one that had not is `degraded` (its record may be incomplete). The exit code
    follows the same rules as ever: the script's own error code wins."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    where = folder / "nanguard_error.txt"
    internal: dict[str, Any] = {"where": "nanguard run's epilogue",
                                "error": f"{type(exc).__name__}: {exc}"}
    try:
        where.write_text(text)
        internal["traceback"] = str(where)
    except OSError:
        pass
    say(f"internal error after the script ended ({type(exc).__name__}: {exc}); the report "
         f"holds what was recorded; traceback in {where} (a nanguard bug, please report it)")
    parts: list[tuple[str, Report]] = []
    for w in disc.watched:
        if w.guard is None:
            continue
        try:
            guard = w.guard
            part = guard.report if guard.closed and guard.report is not None else guard.close(
                ended=outcome.ended, error=outcome.message)
        except Exception:  # noqa: BLE001 - a guard that cannot close adds nothing
            continue
        parts.append((w.name, part))
    with contextlib.suppress(Exception):  # releasing references must not stop the report
        disc.release()
    with contextlib.suppress(Exception):
        release_findings(disc)
    report = _salvage(parts, folder)
    report.run.update({"folder": str(folder), "script": outcome.to_dict(),
                       "internal_error": internal})
    if report.status in OK_STATUSES or report.status == "unwatched":
        report.status = "degraded"
    report.write(folder)
    if summary:
        say(f"status: {report.status}"
             + (f"; first non-finite value at step {report.first_nonfinite.get('step')}"
                if report.first_nonfinite else ""))
    return exit_code(outcome, report)


def _salvage(parts: list[tuple[str, Report]], folder: Path) -> Report:
    """One report over the guards' own (merged when there are several; the first failing
    one if merging fails too)."""
    if len(parts) == 1:
        return parts[0][1]
    if parts:
        try:
            return merge_reports(parts, {"folder": str(folder)})
        except Exception:  # noqa: BLE001 - fall back to a part as it stands
            failing = [r for _, r in parts if r.first_nonfinite]
            return (failing or [parts[0][1]])[0]
    return Report(status="degraded", run={"note": "nanguard stood down before it watched a "
                                                  "step"})


def _preflight_missed(outcome: ScriptOutcome) -> str:
    """Why the preflight never ran (the script never reached an optimizer step)."""
    if outcome.kind == "ok":
        return "the script never stepped an optimizer (nothing to check)"
    return (f"the script ended before its first optimizer step ({outcome.kind}"
            + (f": {outcome.message}" if outcome.message else "") + ")")


def _preflight_only(disc: Discovery, outcome: ScriptOutcome, live: Any, folder: Path) -> int:
    """`--preflight-only`: write the verdict (report.json, status `unwatched`: nothing was
    trained) and choose the exit code: 1 for an error-level finding, 0 for none, 2 when the
    preflight could not run (the script's own error code when it died first)."""
    close_guards(disc, outcome)  # no guard exists before the first step; closed if one does
    verdict = live.result or {}
    report = Report(status="unwatched", run={
        "folder": str(folder), "note": "stopped after the preflight (--preflight-only)",
        "script": outcome.to_dict(), "preflight": verdict}, preflight=verdict)
    report.write(folder)
    if not verdict.get("ran"):
        return outcome.code if outcome.kind in ("exit", "error", "internal") else 2
    return 1 if verdict.get("errors") else 0
