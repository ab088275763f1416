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
   it (integrations/resume.py: a fork of the run taken every `fork_every` seconds while it was
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
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from nanguard.audit.preflight_live import LivePreflight, PreflightStop, verdict_lines
from nanguard.config import DetectConfig, GuardConfig, RecordConfig, WatchConfig
from nanguard.errors import NanguardError
from nanguard.integrations import resume
from nanguard.integrations.discovery import Discovery, Watched
from nanguard.integrations.merge import collect_rank_reports, finding_key, merge_reports
from nanguard.integrations.replay import record_nothing
from nanguard.integrations.resume import ResumePoints
from nanguard.pinpoint.recorded import NotReplayable
from nanguard.record.report import REPORT_NAME, Report
from nanguard.show.progress import waiting
from nanguard.watch import rng

OK_STATUSES = ("healthy", "warned", "recovered")
"""Statuses for which `nanguard run` exits 0 (when the script itself did)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM while the script runs: unwinds it like Ctrl-C (its own `except
    KeyboardInterrupt` and `finally` blocks run), then the run is written `interrupted`."""


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
    """Seconds between resume points (integrations/resume.py: forks of the run that the
    re-run starts from instead of the script's start); 0 turns them off."""
    merge_wait: float = 30.0
    """Under torchrun: seconds rank 0 waits for the other ranks' reports before merging."""
    activations_every: int = 10
    """Per-module activation abs-max every N steps (0: off): the headroom to the dtype's
    limit and the forecast of an overflow, cheaply (hooks return at once between samples)."""
    rerun_every: int = 0
    """`DetectConfig.rerun_every`: re-run one quiet step every N steps and compare bit for
    bit (0: off)."""
    summary: bool = True
    preflight: bool = False
    """Run the preflight at the script's first optimizer step, then train on."""
    preflight_only: bool = False
    """Run the preflight, then stop (exit 1 on an error-level finding, 2 if it could not run)."""


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

    def to_dict(self) -> dict[str, Any]:
        out = {"outcome": self.kind, "exit_code": self.code, "message": self.message}
        if self.evidence:
            out["nonfinite_before_end"] = self.evidence["signals"]
        return out

    @property
    def ended(self) -> str:
        """How the training ended, in the Guard's words (`Guard.close(ended=...)`)."""
        if self.kind == "interrupted":
            return "interrupted"
        return "error" if self.kind in ("exit", "error", "internal") else "ok"


def world() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment (torchrun sets RANK, WORLD_SIZE)."""
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


def default_out(world_size: int) -> Path:
    base = Path("nanguard_runs")
    if world_size > 1:
        # Every rank must pick the same folder without talking: the launcher's run id (or its
        # pid, the parent of every local rank).
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        return base / f"torchrun-{run_id if run_id not in ('', 'none') else os.getppid()}"
    return base / time.strftime("%Y%m%d-%H%M%S")


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
                         detect=DetectConfig(rerun_every=opts.rerun_every),
                         watch=WatchConfig(activations=opts.activations_every > 0,
                                           activations_every=max(1, opts.activations_every))),
                     preflight=live if live is not None and not live.done else None)
    initial_rng = rng.capture()
    points = ResumePoints(opts.fork_every if world_size == 1 else 0.0,
                          failed=lambda: _seen_nonfinite(disc),
                          go=lambda point, message: _go_on(disc, point, message))
    disc.resume = points
    outcome = _run_script(script, opts.args, disc)
    if live is not None and live.result is None:
        live.not_run(_preflight_missed(outcome))
        if opts.summary:
            for line in verdict_lines(live.result or {}, only=opts.preflight_only):
                print(line, file=sys.stderr)
    if opts.preflight_only:
        points.close()
        return _preflight_only(disc, outcome, live, folder)

    try:
        return _finish(opts, script, out, folder, disc, outcome, points, live, initial_rng)
    except Exception as exc:  # noqa: BLE001 - fail open: the run still ends with a report
        points.close()
        return _finish_failed(folder, disc, outcome, exc, summary=opts.summary)


def _finish(opts: RunOptions, script: Path, out: Path, folder: Path, disc: Discovery,
            outcome: ScriptOutcome, points: ResumePoints, live: LivePreflight | None,
            initial_rng: dict[str, Any]) -> int:
    """After the script: settle and close the guards, pinpoint by a re-run when needed, write
    the run folder (merged under torchrun), print the summary; returns the exit code."""
    rank, world_size = world()
    late = _late_finding(disc, outcome, rank)
    for w in disc.watched:
        if w.guard is not None:  # the closing summary below prints the finding
            w.guard.events.summary_follows = opts.summary
        _settle_in_process(w)
    reports = _close(disc, outcome)
    if late is not None:
        w, finding = late
        reports[w.index] = _set_finding(w, finding)
    disc.release()
    replay: dict[str, Any] | None = None
    target = _first_failure(disc.watched, reports)
    if target is not None:
        if _found_in_process(target):
            replay = {"status": "in-process", "step": _failing_step(target)}
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
                replay = _replay(script, opts.args, target, initial_rng, opts.replay_budget,
                                 global_step=late_step, points=points)
            if replay.get("origin"):
                reports[target.index] = _refine(target, replay["origin"])
        if replay["status"] != "in-process" and target.in_process:
            replay["in_process"] = target.in_process.get("reason")
        reports[target.index].run["replay"] = {k: v for k, v in replay.items() if k != "origin"}
    # The points left are of no more use (were this to raise first, each would quit when
    # this process is gone: its pipe closes).
    points.close()

    report = _write(folder, disc.watched, reports, outcome, replay,
                    preflight=live.result if live is not None else None,
                    internal_error=disc.error,
                    resume=points.summary() if opts.fork_every > 0 and world_size == 1 else None)
    if world_size > 1:
        if rank != 0:
            if opts.summary:
                _print_outcome(outcome, script, None, prefix=f"rank {rank}: ", report=report,
                               disc=disc)
            return _exit_code(outcome, report)
        parts, missing = collect_rank_reports(out, world_size, opts.merge_wait)
        report = merge_reports(parts, {"folder": str(out), "world_size": world_size,
                                       "missing_ranks": missing, "script": outcome.to_dict()})
        report.write(out)
        if missing:
            _say(f"no report from rank(s) {missing} within {opts.merge_wait:g} s; merged the rest")
    if opts.summary:
        _print_summary(report, disc, target)
        _print_outcome(outcome, script, replay, report=report, disc=disc)
    return _exit_code(outcome, report)


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
    _say(f"internal error after the script ended ({type(exc).__name__}: {exc}); the report "
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
    report = _salvage(parts, folder)
    report.run.update({"folder": str(folder), "script": outcome.to_dict(),
                       "internal_error": internal})
    if report.status in OK_STATUSES or report.status == "unwatched":
        report.status = "degraded"
    report.write(folder)
    if summary:
        _say(f"status: {report.status}"
             + (f"; first non-finite value at step {report.first_nonfinite.get('step')}"
                if report.first_nonfinite else ""))
    return _exit_code(outcome, report)


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


# ---------------------------------------------------------------------- the preflight


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
    _close(disc, outcome)  # no guard exists before the first step; closed if one does
    verdict = live.result or {}
    report = Report(status="unwatched", run={
        "folder": str(folder), "note": "stopped after the preflight (--preflight-only)",
        "script": outcome.to_dict(), "preflight": verdict}, preflight=verdict)
    report.write(folder)
    if not verdict.get("ran"):
        return outcome.code if outcome.kind in ("exit", "error", "internal") else 2
    return 1 if verdict.get("errors") else 0


# ---------------------------------------------------------------------- running the script


def _run_script(script: Path, args: list[str], disc: Discovery) -> ScriptOutcome:
    """Run `script` as `__main__` with every hook installed; every hook removed afterwards.

    The end-of-run check for a non-finite value no step recorded runs here, while what the
    script held is still alive (its globals; on an error, the frames of its traceback)."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    outcome = ScriptOutcome()
    previous_term = _install_sigterm()
    try:
        sys.argv = [str(script), *args]
        script_dir = str(script.resolve().parent)
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.append(script_dir)
        disc.install()
        script_globals = runpy.run_path(str(script), run_name="__main__")
        _end_steps(disc)
        outcome.evidence = _evidence(disc, on_error=False)
        _attach_while_alive(disc, outcome)
        del script_globals
    except PreflightStop:
        outcome = ScriptOutcome("preflight", 0, "stopped after the preflight (--preflight-only)")
    except SystemExit as exc:
        outcome = _system_exit(exc)
        _end_steps(disc)
        if outcome.kind != "ok":
            outcome.evidence = _evidence(disc, on_error=True)
        _attach_while_alive(disc, outcome)
    except KeyboardInterrupt as exc:
        sigterm = isinstance(exc, Terminated)
        outcome = ScriptOutcome("interrupted", 143 if sigterm else 130,
                                "SIGTERM" if sigterm else "KeyboardInterrupt")
        _end_steps(disc)
    except BaseException as exc:  # noqa: BLE001 - whatever the script raises is reported
        stop = _nanguard_error(exc)
        if stop is not None:
            outcome = ScriptOutcome("stopped", 1, str(stop))
        elif _raised_in_nanguard(exc, script):
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            outcome = ScriptOutcome("internal", 1, f"{type(exc).__name__}: {exc}")
        else:
            _print_script_traceback(exc, script)
            outcome = ScriptOutcome("error", 1, f"{type(exc).__name__}: {exc}")
            _end_steps(disc)
            outcome.evidence = _evidence(disc, on_error=True, tb=exc.__traceback__)
            _attach_while_alive(disc, outcome)
        exc.__traceback__ = None  # let the script's frames (and tensors) go
    finally:
        # A resume point's child ends here, whichever way the script stopped in it.
        resume.child_done(outcome.message if outcome.kind != "ok" else None)
        disc.remove()
        _restore_sigterm(previous_term)
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        sys.stdout.flush()
    return outcome


def _install_sigterm() -> tuple[bool, Any]:
    """SIGTERM raises `Terminated` in the main thread while the script runs. Returns (whether
    it was installed, the previous handler): not in the main thread, signals cannot be set."""

    def on_sigterm(signum: int, frame: Any) -> None:
        raise Terminated("SIGTERM")

    try:
        return True, signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread
        return False, None


def _restore_sigterm(previous: tuple[bool, Any]) -> None:
    installed, handler = previous
    if installed:  # None: the previous handler was not set from Python; the default then
        signal.signal(signal.SIGTERM, signal.SIG_DFL if handler is None else handler)


def _end_steps(disc: Discovery) -> None:
    """End a pending hand-written step; never lets an error out (fail open)."""
    try:
        disc.finish()
    except Exception as exc:  # noqa: BLE001 - the run's record matters more
        _say(f"could not end the last hand-written step: {type(exc).__name__}: {exc}")


def _evidence(disc: Discovery, *, on_error: bool, tb: TracebackType | None = None
              ) -> dict[str, Any] | None:
    if any(w.guard is not None and w.guard.first_nonfinite for w in disc.watched):
        return None  # already recorded by a step: nothing to add
    try:
        return disc.nonfinite_evidence(on_error=on_error, tb=tb)
    except Exception:  # noqa: BLE001 - a check at the end must never fail the run
        return None


def _attach_while_alive(disc: Discovery, outcome: ScriptOutcome) -> None:
    """With evidence of a non-finite value and no guard yet: attach the guard now, while the
    script's objects are still alive (its globals, or the traceback's frames). Discovery holds
    the optimizers and modules it saw weakly; once the script's namespace is gone, whether they
    survive to `_late_finding` depended on garbage-collection timing (seen: a run whose first
    batch was NaN reported `unwatched` whenever bytecode caches made the start faster)."""
    if outcome.evidence is None:
        return
    with contextlib.suppress(Exception):  # fail open: the evidence is still reported
        disc.attach_unstepped()


def _system_exit(exc: SystemExit) -> ScriptOutcome:
    code = exc.code
    if code is None or code == 0:
        return ScriptOutcome()
    if isinstance(code, int):
        return ScriptOutcome("exit", code, f"exit code {code}")
    print(code, file=sys.stderr)  # what Python does with `sys.exit("message")`
    return ScriptOutcome("exit", 1, str(code))


def _nanguard_error(exc: BaseException) -> NanguardError | None:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, NanguardError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


_PASS_THROUGH = ("backward", "wrapper")
"""nanguard's wrappers around torch functions the script calls: an error in them is torch's."""


def _raised_in_nanguard(exc: BaseException, script: Path) -> bool:
    """The exception came out of nanguard's own code (its hooks), not the script's: below the
    script's first frame, the innermost frame outside torch is nanguard's. The `backward`
    wrappers only pass autograd's errors on, as the `wrapper`s of the loss functions and of
    `torch.load` pass on theirs, and a closure nanguard runs first (LBFGS) is the script's
    code: none of these makes an error nanguard's."""
    if isinstance(exc, ValueError):
        # nanguard raises ValueError only for a user's mistake (a Guard(...) call with a
        # folder that holds a run, a misspelled setting): the script's error, not a bug.
        return False
    package = Path(__file__).resolve().parents[1]
    user_dirs = (package / "scenarios",)
    torch_dir = Path(torch_file()).resolve().parent
    target = script.resolve()
    tb, in_script, last_is_ours = exc.__traceback__, False, False
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename).resolve()
        in_script = in_script or path == target
        if in_script and torch_dir not in path.parents and not code.co_filename.startswith("<"):
            ours = package in path.parents and not any(d in path.parents for d in user_dirs)
            if not (ours and code.co_name in _PASS_THROUGH):
                last_is_ours = ours
        tb = tb.tb_next
    return last_is_ours


def torch_file() -> str:
    import torch

    return torch.__file__


def _print_script_traceback(exc: BaseException, script: Path) -> None:
    """The traceback as Python would print it, starting at the script's first frame."""
    target = script.resolve()
    tb = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve() != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__, file=sys.stderr)


# ---------------------------------------------------------------------- guards and reports


def _close(disc: Discovery, outcome: ScriptOutcome) -> dict[int, Report]:
    """Close every guard, telling it how the script ended."""
    reports: dict[int, Report] = {}
    for w in disc.watched:
        if w.guard is None:
            continue
        reports[w.index] = _close_guard(w, outcome)
    return reports


def _close_guard(w: Watched, outcome: ScriptOutcome) -> Report:
    guard = w.guard
    assert guard is not None
    return guard.close(ended=outcome.ended, error=outcome.message)


def _late_finding(disc: Discovery, outcome: ScriptOutcome, rank: int
                  ) -> tuple[Watched, dict[str, Any]] | None:
    """The finding for a non-finite value the script held when it ended that no guarded step
    recorded, and the part it belongs to (a guard attached now if none was); None if none."""
    if outcome.evidence is None:
        return None
    try:
        w = disc.attach_unstepped()
    except Exception:  # noqa: BLE001 - fail open: the evidence is still reported
        w = None
    if w is None or w.guard is None:
        return None
    step = w.guard.step
    evidence = outcome.evidence
    # A raised forward that held the value names its phase and module (held.py); the re-run
    # then names the op.
    finding = {"step": step, "phase": evidence.get("phase"), "module": evidence.get("module"),
               "op": None, "source": None, "samples": [], "rank": rank,
               "signals": list(evidence["signals"]), "after_last_step": True}
    return w, finding


def _set_finding(w: Watched, finding: dict[str, Any]) -> Report:
    guard = w.guard
    assert guard is not None
    return guard.refine(finding)


_REPLAYED_PHASES = ("forward", "loss", "backward")
"""Phases an in-process replay of the step's forward and backward can name for good."""


def _settle_in_process(w: Watched) -> None:
    """After the script: keep the guard's in-process origin, or, when there is none to keep
    (the step could not be replayed, ran clean, or did not give the same loss bit for bit), put
    the finding back as the watched signals gave it and say why (`w.in_process["reason"]`)."""
    info, guard = w.in_process, w.guard
    if info is None or guard is None or guard.first_nonfinite is None:
        return
    first = guard.first_nonfinite  # a copy: set back below when it changes
    error = first.pop("replay_error", None)
    changed = error is not None  # the report of a closed guard still holds it
    if changed:
        guard.first_nonfinite = first
    if error is not None and str(error).startswith(NotReplayable.__name__):
        info.setdefault("reason", str(error).partition(": ")[2])
    elif error is not None:
        info.setdefault("reason", f"the in-process replay failed: {error}")
    elif first.get("op") and first.get("phase") in _REPLAYED_PHASES:
        if first.get("reproduced") is not False:
            info["found"] = True
            return
        info["reason"] = ("the in-process replay did not give the step's loss bit for bit "
                          "(state changed between the forward and the update?)")
    info.setdefault("reason", "the in-process replay found no op that made the value in that "
                    "step (it came with the step's inputs?)")
    if first != info["before"]:
        guard.first_nonfinite = dict(info["before"])
        changed = True
    if not changed:
        return
    if guard.closed:
        # The `raise` policy closed the guard (and its store) while the script ran: the
        # finding goes into its report instead, diagnosed again.
        guard.refine(guard.first_nonfinite)
    else:
        guard.store.write_finding(guard.first_nonfinite)


def _failing_step(w: Watched) -> int:
    assert w.guard is not None and w.guard.first_nonfinite is not None
    return int(w.guard.first_nonfinite["step"])


def _found_in_process(w: Watched) -> bool:
    return bool(w.in_process and w.in_process.get("found") and w.guard is not None
                and w.guard.first_nonfinite is not None)


def _first_failure(watched: list[Watched], reports: dict[int, Report]) -> Watched | None:
    found = [
        (finding_key(r.first_nonfinite, i), w)
        for i, w in enumerate(watched)
        if (r := reports.get(w.index)) is not None and r.first_nonfinite
    ]
    return min(found, key=lambda f: f[0])[1] if found else None


def _refine(w: Watched, origin: dict[str, Any]) -> Report:
    """Fold the re-run's origin into the guard's finding and diagnose it again."""
    guard = w.guard
    assert guard is not None and guard.first_nonfinite is not None
    first = guard.first_nonfinite
    keep = {k: first.get(k) for k in ("step", "rank", "signals")}
    if first.get("samples"):
        # The guard's rows are rows of the step's batch (what `samples` means); the re-run may
        # have met the value earlier, in the whole data set a collate function reads from:
        # those rows are kept apart.
        keep["samples"] = first["samples"]
        if origin.get("samples") and origin["samples"] != first["samples"]:
            keep["origin_rows"] = origin["samples"]
    first.update({k: v for k, v in origin.items() if v is not None and v != []})
    first.update(keep)
    return guard.refine(first)


def _write(
    folder: Path,
    watched: list[Watched],
    reports: dict[int, Report],
    outcome: ScriptOutcome,
    replay: dict[str, Any] | None,
    *,
    preflight: dict[str, Any] | None = None,
    internal_error: dict[str, Any] | None = None,
    resume: dict[str, Any] | None = None,
) -> Report:
    """Lay out this process's run folder; return its report (merged over optimizers); the
    preflight's verdict goes under `run.preflight`; `internal_error` is an error of the
    runner's own hooks (nanguard stood down; with no guard yet, the run is `degraded`)."""
    errors = {w.name: w.error for w in watched if w.error}
    if len(reports) == 1:
        (index, report), = reports.items()
        w = next(w for w in watched if w.index == index)
        _move_into(w.folder, folder)
        report.run["folder"] = str(folder)
    elif reports:
        for w in watched:
            if w.index in reports:
                reports[w.index].run["folder"] = str(w.folder)
                reports[w.index].write(w.folder)
        parts = [(w.name, reports[w.index]) for w in watched if w.index in reports]
        report = merge_reports(parts, {"folder": str(folder)})
    elif internal_error is not None:
        report = Report(status="degraded",
                        run={"folder": str(folder), "internal_error": internal_error,
                             "note": "nanguard stood down before it watched a step"})
    else:
        report = Report(status="unwatched",
                        run={"folder": str(folder), "note": "no optimizer stepped"})
    report.run["script"] = outcome.to_dict()
    notes = [w.note for w in watched if w.note]
    if notes:
        report.run["notes"] = notes
    if replay is not None:
        report.run["replay"] = {k: v for k, v in replay.items() if k != "origin"}
        _why_undetermined(report, replay)
    if errors:
        report.run["errors"] = errors
    if resume is not None:
        report.run["resume_points"] = resume
    if preflight is not None:
        report.run["preflight"] = preflight
        report.preflight = preflight
    rank, world_size = world()
    if world_size > 1:
        report.run["rank"] = rank
    report.write(folder)
    return report


def _why_undetermined(report: Report, replay: dict[str, Any]) -> None:
    """An `undetermined` diagnosis says why the re-run could not give the op, when it tried."""
    reason = replay.get("reason") or replay.get("in_process")
    for entry in report.diagnosis:
        if entry.get("cause") == "undetermined" and reason and reason not in entry["evidence"]:
            entry["evidence"] += f" (the re-run: {reason})"


def _move_into(src: Path, dst: Path) -> None:
    """Move a single optimizer's record up into the run folder (report.json is rewritten)."""
    if not src.is_dir() or src == dst:
        return
    for item in src.iterdir():
        if item.name == REPORT_NAME:
            continue
        target = dst / item.name
        if target.exists():
            if target.is_dir():
                shutil.rmtree(target)
            else:
                target.unlink()
        shutil.move(str(item), str(target))
    shutil.rmtree(src, ignore_errors=True)


# ---------------------------------------------------------------------- the re-run


def _seen_nonfinite(disc: Discovery) -> bool:
    return any(w.guard is not None and w.guard.first_nonfinite is not None
               for w in disc.watched)


def _go_on(disc: Discovery, point: Any, message: dict[str, Any]) -> None:
    """In a resume point's child: let go of the run's hooks (its guards record nothing
    here, nor does any guard the script builds) and arm the checker at the failing step."""
    disc.stand_aside()
    record_nothing()
    resume.arm_child(point, message)


def _replay(
    script: Path, args: list[str], w: Watched, initial_rng: dict[str, Any], budget: float,
    *, global_step: int | None = None, points: ResumePoints | None = None,
) -> dict[str, Any]:
    """Run the failing step again with the checker armed: from the newest resume point
    before it when there is one, else the whole script in a subprocess (`global_step`
    overrides the step counted over all optimizers: a value found after the last step is in
    the step that never completed)."""
    guard = w.guard
    assert guard is not None and guard.first_nonfinite is not None
    step = int(guard.first_nonfinite["step"])
    if global_step is None:
        global_step = w.global_step(step)
    info: dict[str, Any] = {"status": "error", "step": step, "budget_s": budget}
    if global_step is None:
        info["reason"] = "the failing step was not seen starting"
        return info
    info["global_step"] = global_step
    expected = _failing_loss(guard, step)
    if points is not None:
        resumed = points.replay(global_step, expect_loss=expected, budget=budget)
        if resumed is not None:
            if resumed["status"] == "found":
                resumed["origin"]["step"] = step
            if resumed["status"] in ("found", "budget_exhausted"):
                info.update(resumed, mode="resume_point")
                if resumed["status"] == "budget_exhausted":
                    info["reason"] = (f"the re-run from the resume point at step "
                                      f"{resumed['from_step']} did not finish within "
                                      f"--replay-budget {budget:g} s")
                return info
            # Clean there (its sums in another order?) or gone: from the start, in the time
            # that is left.
            info["resume_point"] = {k: resumed.get(k) for k in ("from_step", "status",
                                                                 "reason", "seconds")}
            budget = max(1.0, budget - float(resumed.get("seconds") or 0.0))
        elif points.refused:
            info["resume_point"] = {"status": "not_taken", "reason": points.refused}
    info["mode"] = "from_start"
    with tempfile.TemporaryDirectory(prefix="nanguard-replay-") as tmp:
        rng_file, result_file, log_file = (Path(tmp) / n for n in ("rng.pt", "result.json",
                                                                      "stderr.txt"))
        rng_file.write_bytes(rng.dumps(initial_rng))
        cmd = [sys.executable, "-m", "nanguard.integrations.replay", "--step", str(global_step),
               "--rng", str(rng_file), "--result", str(result_file), "--", str(script), *args]
        env = dict(os.environ)
        if expected is not None:  # `reproduced`: the re-run's loss at that step, bit for bit
            env["NANGUARD_EXPECT_LOSS"] = repr(expected)
        src_root = str(Path(__file__).resolve().parents[2])  # importable as we are
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)
        started = time.monotonic()
        with open(log_file, "wb") as log:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=log, env=env, start_new_session=True)
            try:
                proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                _kill(proc)
                info.update(status="budget_exhausted", seconds=round(time.monotonic() - started,
                                                                       2),
                            reason=f"the re-run did not finish within --replay-budget {budget:g} s;"
                            " the finding is from the watched signals only")
                return info
        info["seconds"] = round(time.monotonic() - started, 2)
        if not result_file.is_file():
            tail = log_file.read_text(errors="replace")[-400:].strip()
            info["reason"] = f"the re-run exited with code {proc.returncode}: {tail}"
            return info
        result = json.loads(result_file.read_text())
    origin = result.get("origin")
    if origin and origin.get("phase"):
        origin["step"] = step
        info.update(status="found", origin=origin)
    else:
        info.update(status="not_reproduced",
                    reason="the re-run was clean at that step (non-deterministic script?)"
                    if result.get("ran") else "the re-run never reached that step")
    return info


def _failing_loss(guard: Any, step: int) -> float | None:
    stats = getattr(guard, "failing_stats", None)
    if stats is None or stats.step != step or stats.loss is None:
        return None
    return float(stats.loss)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the re-run and everything it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


# ---------------------------------------------------------------------- output


def _say(line: str, prefix: str = "") -> None:
    print(f"nanguard run: {prefix}{line}", file=sys.stderr)


def _print_summary(report: Report, disc: Discovery, target: Watched | None) -> None:
    from nanguard.show.summary import print_summary

    history = target.guard.history if target is not None and target.guard is not None else []
    parts: dict[str, Any] = {}
    if len(disc.watched) > 1:
        parts = {w.name: w.guard.history for w in disc.watched if w.guard is not None}
    elif not history and len(disc.watched) == 1 and disc.watched[0].guard is not None:
        history = disc.watched[0].guard.history
    sys.stdout.flush()
    print_summary(report, history, parts_history=parts or None)


def _print_outcome(outcome: ScriptOutcome, script: Path, replay: dict[str, Any] | None,
                   prefix: str = "", *, report: Report | None = None,
                   disc: Discovery | None = None) -> None:
    if disc is not None:
        for w in disc.watched:
            if w.note:
                _say(w.note, prefix=prefix)
            if w.error:
                _say(f"could not watch {w.name} ({type(w.optimizer).__name__}): {w.error}",
                     prefix=prefix)
    if replay is not None and replay.get("status") == "budget_exhausted":
        _say(f"the re-run to pinpoint the origin ran out of its budget "
             f"(--replay-budget {replay['budget_s']:g} s); the finding above is from the "
             "watched signals only", prefix=prefix)
    elif replay is not None and replay.get("status") in ("error", "not_reproduced"):
        _say(f"the re-run could not pinpoint the origin: {replay.get('reason')}", prefix=prefix)
    numerical = report is not None and report.first_nonfinite is not None
    if outcome.kind == "exit":
        _say(f"{script.name} exited with code {outcome.code} (the script's own exit"
             + (", after non-finite values appeared: see above)" if numerical
                else ", not a nanguard failure)"), prefix=prefix)
    elif outcome.kind == "error" and numerical:
        _say(f"{script.name} failed with an error after non-finite values appeared: a "
             f"numerical failure (see above): {outcome.message}", prefix=prefix)
    elif outcome.kind == "error":
        _say(f"{script.name} failed with its own error, not a numerical one: "
             f"{outcome.message}", prefix=prefix)
    elif outcome.kind == "internal":
        _say(f"nanguard itself failed while {script.name} ran (a nanguard bug, please report "
             f"it): {outcome.message}", prefix=prefix)
    elif outcome.kind == "stopped":
        _say(f"training stopped by the raise policy: {outcome.message}", prefix=prefix)
    elif outcome.kind == "interrupted":
        _say(f"{script.name} was interrupted ({outcome.message}); the record holds every "
             "step up to then", prefix=prefix)
    if report is not None and report.status == "unwatched":
        _say(_unwatched_reason(disc), prefix=prefix)


def _unwatched_reason(disc: Discovery | None) -> str:
    started = disc.processes_started if disc is not None else 0
    if started:
        return (f"nothing was watched: no optimizer stepped and no backward ran in this "
                f"process, and it started {started} worker process(es); training inside "
                "worker processes (torch.multiprocessing, Hogwild) is not watched")
    return ("nothing was watched: the script ran no optimizer step and no backward() in "
            "this process")


def _exit_code(outcome: ScriptOutcome, report: Report) -> int:
    """The script's own non-zero code wins; else 1 unless the status is one a CI gate may
    pass (`healthy`, `warned`, `recovered`)."""
    if outcome.kind in ("exit", "error", "interrupted", "internal"):
        return outcome.code
    if outcome.kind == "stopped" or report.status not in OK_STATUSES:
        return 1
    return 0
