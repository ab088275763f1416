"""`nanguard replay RUN [--step N]`: re-run a recorded run with the op checker armed at step N.

The run must say how to run it again: runs of `nanguard demo` record their scenario and seed,
runs of `nanguard run` record the script, its arguments and working directory. The re-run is
deterministic (seeded training on the same machine), so the armed step is the recorded one; the
command prints the origin (phase, module, op, source, samples), whether it matches the record,
and the diagnosis.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from nanguard.cli.main import add_command, add_json, wants_json
from nanguard.errors import UserError
from nanguard.record.report import load_report
from nanguard.record.store import open_run
from nanguard.show.progress import waiting


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "replay",
        help="re-run a recorded run with the op checker armed",
        description=__doc__,
        ok="the step ran clean under the op checker",
        one="a non-finite value was found (its origin is printed), or the re-run never "
        "reached the step",
        two="bad arguments, not a run folder, or a run that does not say how to run it again",
    )
    p.add_argument("run", help="a run folder recorded by `nanguard demo` or `nanguard run`")
    p.add_argument(
        "--step",
        type=int,
        default=None,
        help="step to check (default: the recorded first non-finite step)",
    )
    add_json(p, "the origin")
    p.set_defaults(func=run)


def _meta(folder: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The run's meta table and the RNG states it started with."""
    from nanguard.watch import rng

    db = open_run(folder)
    try:
        meta = {k: json.loads(v) for k, v in db.execute("SELECT key, value FROM meta")}
        row = db.execute("SELECT state FROM rng WHERE step = 0").fetchone()
    finally:
        db.close()
    return meta, (rng.loads(row[0]) if row else None)


def _rerun(meta: dict[str, Any], start_rng: dict[str, Any] | None) -> None:
    """Run the recorded training again, in this process, with nothing guarding it."""
    scenario = meta.get("scenario")
    if isinstance(scenario, dict) and scenario.get("name") == "cascade":
        from nanguard.scenarios.cascade import train_cascade

        train_cascade(int(scenario["seed"]), steps=int(scenario.get("steps", 300)))
        return
    script = meta.get("script")
    if isinstance(script, str):
        from nanguard.watch import rng

        if int(meta.get("optimizers", 1)) > 1:
            raise UserError("this run stepped several optimizers; `nanguard run` re-runs it "
                            "with the checker armed by itself (see report.json run.replay)")
        if not Path(script).is_file():
            raise UserError(f"the recorded script {script!r} no longer exists")
        old_argv, old_cwd = sys.argv[:], os.getcwd()
        if start_rng is not None:
            rng.restore(start_rng)  # the script's unseeded randomness as in the recorded run
        sys.argv = [script, *meta.get("argv", [])]
        try:
            os.chdir(meta.get("cwd") or old_cwd)
            runpy.run_path(script, run_name="__main__")
        except SystemExit:
            pass
        finally:
            sys.argv = old_argv
            os.chdir(old_cwd)
        return
    raise UserError(
        "this run does not record how to run it again (only runs of `nanguard demo` and "
        "`nanguard run` do): run the script under `nanguard run`, which pinpoints the origin "
        "by itself, or arm the checker in your code (nanguard.pinpoint.armed, see the docs)"
    )


def run(args: argparse.Namespace) -> int:
    # torch is imported here, not at the top: `nanguard --help` builds every parser.
    from nanguard.explain import Evidence, diagnose
    from nanguard.pinpoint import armed

    report = load_report(args.run)
    meta, start_rng = _meta(args.run)
    recorded = report.first_nonfinite or {}
    step = args.step if args.step is not None else recorded.get("step")
    if step is None:
        raise UserError("the run never went non-finite; pass --step N to check a step")
    # `steps` counts completed updates: the step a stopping policy ended in (the recorded
    # first non-finite one, `steps` itself) never completed and can still be re-run.
    if step < 0 or step > report.steps:
        raise UserError(f"--step {step} is outside the run's {report.steps} steps")
    from rich.console import Console  # here: every command's parser imports this module

    console = Console()
    with waiting(f"re-running the script to step {step} under the op checker"), \
            armed(int(step)) as a:
        _rerun(meta, start_rng)
    if not a.ran:
        console.print(f"the re-run never reached step {step}")
        return 1
    origin = a.origin
    if wants_json(args):
        print(json.dumps(origin.to_dict() if origin else None, indent=2))
        return 0 if origin is None else 1
    if origin is None:
        console.print(
            f"step {step} ran clean under the op checker: no non-finite value "
            "(a failure that does not reproduce suggests non-determinism)"
        )
        return 0
    found = origin.to_dict()
    console.print(
        f"[bold]step {step}[/]: first non-finite value produced by [bold]{found['op']}"
        f"[/] in the {found['phase']} phase, module {found['module']!r}"
    )
    if found.get("source"):
        console.print(f"  source: {found['source']}")
    if found.get("samples"):
        console.print(f"  samples: {found['samples'][:16]}")
    if found.get("propagated_by"):
        p = found["propagated_by"]
        console.print(
            f"  then carried on by {p.get('op')} ({p.get('phase')}): what a tool that "
            "names the first non-finite output would blame"
        )
    same = _same_origin(recorded, found, step)
    if recorded and recorded.get("step") == step:
        console.print(
            "  matches the recorded finding"
            if same
            else f"  recorded: phase {recorded.get('phase')}, op {recorded.get('op')}, module "
            f"{recorded.get('module')!r}, source {recorded.get('source')} (seen from the "
            "watched signals)"
        )
    if same and report.diagnosis:
        # The same origin: the record's diagnosis is the one computation over it (it also
        # saw the run's history and optimizer settings, which this re-run does not).
        causes = [(c.get("cause"), c.get("fix")) for c in report.diagnosis[:2]]
    else:
        evidence = Evidence(
            first_nonfinite={**recorded, **{k: v for k, v in found.items() if v is not None}},
            alarms=report.alarms,
        )
        causes = [(c.cause, c.fix) for c in diagnose(evidence)[:2]]
    for cause, fix in causes:
        console.print(f"  cause: [bold]{cause}[/] — fix: {fix}")
    return 1


def _same_origin(recorded: dict[str, Any], found: dict[str, Any], step: int) -> bool:
    """The re-run found the recorded origin: the same step, phase, op, module and line (a
    field the record left empty, seen from the watched signals only, is not compared)."""
    return bool(recorded) and recorded.get("step") == step and all(
        recorded.get(k) in (None, found.get(k)) for k in ("phase", "op", "module")) and (
        recorded.get("source") is None or _same_line(recorded["source"], found.get("source")))


def _same_line(a: str, b: str | None) -> bool:
    """`path:line` `a` and `b` name one line: the same line number, and one path is the other
    or ends with it (a path is shown relative to the folder it ran from when inside it)."""
    if b is None:
        return False
    (pa, _, la), (pb, _, lb) = a.rpartition(":"), b.rpartition(":")
    ka, kb = Path(pa).parts, Path(pb).parts
    n = min(len(ka), len(kb))
    return la == lb and n > 0 and ka[-n:] == kb[-n:]
