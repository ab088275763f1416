"""Zero-code mode: run an unmodified training script under nanguard (`nanguard run`).

The script runs in this process as `__main__` (`runpy.run_path`, `sys.argv` rewritten,
`sys.path[0]` = the script's folder, as `python -m cProfile` does) while `Discovery` attaches a
guard to every optimizer that steps. When the script is done:

1. each guard is closed (one run folder per optimizer: DIR itself when there is one, else
   DIR/optimizer-N plus a merged DIR/report.json; under torchrun DIR/rank-R/ per rank);
2. on a non-finite value (single process), the script is re-run deterministically in a
   subprocess (same initial RNG states) with `pinpoint.armed(step)` at the failing step, within
   `replay_budget` seconds; its origin refines `first_nonfinite` and the diagnosis is redone;
3. under torchrun, rank 0 merges the ranks' reports from their files (never through the
   process group, so a dead rank cannot hang it);
4. the summary is printed (rank 0 only) and the exit code chosen: the script's own non-zero
   code, or an error of the script itself, wins (with a line saying it was the script); else 1
   when training failed or `raise` stopped it, else 0.

Every global hook and patch is removed in `finally`, and `sys.argv` / `sys.path` restored.
"""

from __future__ import annotations

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
from typing import Any

from nanguard.config import GuardConfig, RecordConfig
from nanguard.errors import NanguardError
from nanguard.integrations.discovery import Discovery, Watched
from nanguard.integrations.merge import collect_rank_reports, finding_key, merge_reports
from nanguard.record.report import REPORT_NAME, Report
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
    merge_wait: float = 30.0
    """Under torchrun: seconds rank 0 waits for the other ranks' reports before merging."""
    summary: bool = True


@dataclass
class ScriptOutcome:
    """How the script ended."""

    kind: str = "ok"
    """`ok`, `exit` (SystemExit with a non-zero code), `error` (an exception of its own),
    `stopped` (nanguard's `raise` policy), `internal` (an error inside nanguard's own hooks) or
    `interrupted`."""
    code: int = 0
    message: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.kind, "exit_code": self.code, "message": self.message}


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

    disc = Discovery(lambda i: folder / f"optimizer-{i}", policy=opts.policy,
                     config=GuardConfig(record=RecordConfig(summary=False)))
    initial_rng = rng.capture()
    outcome = _run_script(script, opts.args, disc)

    reports = _close(disc)
    replay: dict[str, Any] | None = None
    target = _first_failure(disc.watched, reports)
    if target is not None:
        if world_size > 1:
            replay = {"status": "skipped", "reason": "torch.distributed: one rank cannot re-run "
                      "a multi-rank script; the watched signals name the rank and batch"}
        elif opts.replay_budget <= 0:
            replay = {"status": "skipped", "reason": "--replay-budget 0"}
        else:
            replay = _replay(script, opts.args, target, initial_rng, opts.replay_budget)
            if replay.get("origin"):
                reports[target.index] = _refine(target, replay["origin"])
        reports[target.index].run["replay"] = {k: v for k, v in replay.items() if k != "origin"}

    report = _write(folder, disc.watched, reports, outcome, replay)
    if world_size > 1:
        if rank != 0:
            if opts.summary:
                _print_outcome(outcome, script, None, prefix=f"rank {rank}: ")
            return _exit_code(outcome, report)
        parts, missing = collect_rank_reports(out, world_size, opts.merge_wait)
        report = merge_reports(parts, {"folder": str(out), "world_size": world_size,
                                       "missing_ranks": missing, "script": outcome.to_dict()})
        report.write(out)
        if missing:
            _say(f"no report from rank(s) {missing} within {opts.merge_wait:g} s; merged the rest")
    if opts.summary:
        _print_summary(report, disc, target)
        _print_outcome(outcome, script, replay)
    return _exit_code(outcome, report)


# ---------------------------------------------------------------------- running the script


def _run_script(script: Path, args: list[str], disc: Discovery) -> ScriptOutcome:
    """Run `script` as `__main__` with every hook installed; every hook removed afterwards."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    outcome = ScriptOutcome()
    try:
        sys.argv = [str(script), *args]
        script_dir = str(script.resolve().parent)
        if sys.path:
            sys.path[0] = script_dir
        else:
            sys.path.append(script_dir)
        disc.install()
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        outcome = _system_exit(exc)
    except KeyboardInterrupt:
        outcome = ScriptOutcome("interrupted", 130, "interrupted")
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
    finally:
        disc.remove()
        sys.argv = saved_argv
        if saved_path0 is not None:
            sys.path[0] = saved_path0
        sys.stdout.flush()
    return outcome


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


def _raised_in_nanguard(exc: BaseException, script: Path) -> bool:
    """The exception came out of nanguard's own code (its hooks), not the script's."""
    package = Path(__file__).resolve().parents[1]
    target = script.resolve()
    tb, in_script = exc.__traceback__, False
    while tb is not None:
        code = tb.tb_frame.f_code
        path = Path(code.co_filename).resolve()
        in_script = in_script or path == target
        # The `backward` wrapper only passes the script's own autograd errors on.
        if in_script and package in path.parents and code.co_name != "backward":
            return True
        tb = tb.tb_next
    return False


def _print_script_traceback(exc: BaseException, script: Path) -> None:
    """The traceback as Python would print it, starting at the script's first frame."""
    target = script.resolve()
    tb = exc.__traceback__
    while tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve() != target:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__, file=sys.stderr)


# ---------------------------------------------------------------------- guards and reports


def _close(disc: Discovery) -> dict[int, Report]:
    reports: dict[int, Report] = {}
    for w in disc.watched:
        if w.guard is None:
            continue
        reports[w.index] = w.guard.close()
    return reports


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
    first.update({k: v for k, v in origin.items() if v is not None and v != []})
    first.update(keep)
    return guard.refine(first)


def _write(
    folder: Path,
    watched: list[Watched],
    reports: dict[int, Report],
    outcome: ScriptOutcome,
    replay: dict[str, Any] | None,
) -> Report:
    """Lay out this process's run folder; return its report (merged over optimizers)."""
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
    else:
        report = Report(run={"folder": str(folder), "note": "no optimizer stepped"})
    report.run["script"] = outcome.to_dict()
    if replay is not None:
        report.run["replay"] = {k: v for k, v in replay.items() if k != "origin"}
    if errors:
        report.run["errors"] = errors
    rank, world_size = world()
    if world_size > 1:
        report.run["rank"] = rank
    report.write(folder)
    return report


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


def _replay(
    script: Path, args: list[str], w: Watched, initial_rng: dict[str, Any], budget: float
) -> dict[str, Any]:
    """Re-run the script in a subprocess with the checker armed at the failing step."""
    guard = w.guard
    assert guard is not None and guard.first_nonfinite is not None
    step = int(guard.first_nonfinite["step"])
    global_step = w.global_step(step)
    info: dict[str, Any] = {"status": "error", "step": step, "budget_s": budget}
    if global_step is None:
        info["reason"] = "the failing step was not seen starting"
        return info
    info["global_step"] = global_step
    with tempfile.TemporaryDirectory(prefix="nanguard-replay-") as tmp:
        rng_file, result_file, log_file = (Path(tmp) / n for n in ("rng.pt", "result.json",
                                                                      "stderr.txt"))
        rng_file.write_bytes(rng.dumps(initial_rng))
        cmd = [sys.executable, "-m", "nanguard.integrations.replay", "--step", str(global_step),
               "--rng", str(rng_file), "--result", str(result_file), "--", str(script), *args]
        env = dict(os.environ)
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
    if not history and len(disc.watched) == 1 and disc.watched[0].guard is not None:
        history = disc.watched[0].guard.history
    sys.stdout.flush()
    if not disc.watched:
        _say("no optimizer stepped: nothing was watched")
    print_summary(report, history)


def _print_outcome(outcome: ScriptOutcome, script: Path, replay: dict[str, Any] | None,
                   prefix: str = "") -> None:
    if replay is not None and replay.get("status") == "budget_exhausted":
        _say(f"the re-run to pinpoint the origin ran out of its budget "
             f"(--replay-budget {replay['budget_s']:g} s); the finding above is from the "
             "watched signals only", prefix=prefix)
    elif replay is not None and replay.get("status") in ("error", "not_reproduced"):
        _say(f"the re-run could not pinpoint the origin: {replay.get('reason')}", prefix=prefix)
    if outcome.kind == "exit":
        _say(f"{script.name} exited with code {outcome.code} (the script's own exit, "
             "not a nanguard failure)", prefix=prefix)
    elif outcome.kind == "error":
        _say(f"{script.name} failed with its own error, not a numerical one: "
             f"{outcome.message}", prefix=prefix)
    elif outcome.kind == "internal":
        _say(f"nanguard itself failed while {script.name} ran (a nanguard bug, please report "
             f"it): {outcome.message}", prefix=prefix)
    elif outcome.kind == "stopped":
        _say(f"training stopped by the raise policy: {outcome.message}", prefix=prefix)


def _exit_code(outcome: ScriptOutcome, report: Report) -> int:
    if outcome.kind in ("exit", "error", "interrupted", "internal"):
        return outcome.code
    if outcome.kind == "stopped" or report.status == "failed":
        return 1
    return 0
