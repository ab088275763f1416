"""`nanguard run [OPTIONS] SCRIPT [ARGS...]`: run an unmodified training script under nanguard.

Every optimizer the script steps gets a guard (found through PyTorch's global hooks, with its
model, loss and batch); the run is recorded in --out (one folder per optimizer when there are
several, one per rank under torchrun, with a merged report.json on top). On a non-finite value
the failing step is replayed in process under the op checker when it can be; otherwise it is
run again with the checker armed (within --replay-budget seconds): from the newest resume point
before it (a fork of the run taken every --fork-every seconds while it was healthy) or, without
one, the script from its start in a subprocess. Works under
`torchrun --nproc-per-node N -m nanguard run train.py ...`.

Scripts with no optimizer (hand-written updates) get a step per backward(); LBFGS closures
are checked after they ran. SIGTERM (a scheduler's time limit) unwinds the script like Ctrl-C
and writes the report (status interrupted, or failed after a non-finite value).

--preflight checks the model before it trains: at the script's first optimizer step, copies of
its model, optimizer and batch get the init scale per layer, the loss's numerics (sigmoid into
BCELoss, log without a floor), an LR range probe against the script's LR and an overfit-one-batch
check; the verdict is printed and written to report.json (run.preflight), and training goes on
untouched. --preflight-only stops after the verdict: exit 1 for an error-level finding, 0 for
none, 2 when the preflight could not run (a CI gate).

While the script trains, each alarm episode (as it starts and as it escalates), each action
and the finding are logged to stderr as they happen (logger `nanguard`; --quiet, --log-level).

Options go before SCRIPT; everything after SCRIPT is the script's own. The script's output and
exit code are kept; otherwise the exit code is 0 for the statuses healthy, warned and
recovered, and 1 for failed, crashed, unwatched, degraded, interrupted (or stopped by --policy
raise).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from nanguard.cli.main import add_command
from nanguard.config import OBJECTIVES, POLICIES
from nanguard.errors import UserError

# What a run leaves in its folder (record/store.py, run/run_reports.py): replaced by
# --overwrite; anything else there is the user's and stays.
RUN_FILES = ("run.db", "run.db-wal", "run.db-shm", "report.json", "report.html",
             "nanguard_error.txt")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "run",
        help="run a training script unmodified, watched by nanguard (also under torchrun)",
        description=__doc__,
        ok="healthy, warned or recovered (--preflight-only: no error-level finding)",
        one="failed, crashed, interrupted, unwatched or degraded, or stopped by --policy "
        "raise (--preflight-only: an error-level finding); the script's own non-zero exit "
        "code is passed on instead",
        two="bad options or no such script (--preflight-only: the preflight could not run)",
    )
    p.add_argument("--out", default=None,
                   help="run folder (default: nanguard_runs/<time>; under torchrun "
                        "nanguard_runs/torchrun-<run id>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run already in --out (default: refuse, so two runs "
                        "never mix by accident)")
    p.add_argument("--policy", default="observe", choices=list(POLICIES),
                   help="what to do on a non-finite value (default: observe)")
    p.add_argument("--replay-budget", type=float, default=120.0, metavar="SECONDS",
                   help="time allowed for the re-run that pinpoints the origin "
                        "(default 120; 0 turns it off)")
    p.add_argument("--fork-every", type=float, default=30.0, metavar="SECONDS",
                   help="take a resume point (a fork of the run, copy-on-write) every SECONDS "
                        "while it is healthy, so the pinpointing re-run starts shortly before "
                        "the failure, not at the script's start (default 30; 0 turns it off; "
                        "never with CUDA, worker processes or sockets)")
    p.add_argument("--merge-wait", type=float, default=30.0, metavar="SECONDS",
                   help="under torchrun: how long rank 0 waits for the other ranks' reports "
                        "(default 30)")
    p.add_argument("--activations-every", type=int, default=10, metavar="N",
                   help="measure per-module activation abs-max (headroom to the dtype's limit, "
                        "the forecast of an overflow) every N steps (default 10; 0 turns it "
                        "off; a torch.compile'd model is not hooked)")
    p.add_argument("--rerun-every", type=int, default=0, metavar="N",
                   help="re-run one quiet step every N steps before its update and compare it "
                        "bit for bit: a step that computes differently the second time is a "
                        "rerun_mismatch alarm (a flipped bit, a faulty device, a "
                        "non-deterministic kernel); one more forward and backward every N "
                        "steps (default 0: off)")
    p.add_argument("--objective", default="auto", choices=list(OBJECTIVES),
                   help="is the loss a stationary series? auto (default): yes unless the run "
                        "shows on-policy RL or a GAN, whose loss moves without anything going "
                        "wrong (then its trend alarms are off; gradient and non-finite ones "
                        "stay); stationary: trend alarms always on; nonstationary: off")
    p.add_argument("--preflight", action="store_true",
                   help="check init, loss numerics and LR on copies at the first optimizer "
                        "step, print the verdict, then train on")
    p.add_argument("--preflight-only", action="store_true",
                   help="run the preflight and stop: exit 1 on an error-level finding, else 0 "
                        "(2: it could not run)")
    p.add_argument("--quiet", action="store_true",
                   help="no live lines while the script trains (alarms, actions, the finding "
                        "go to the run folder only; the closing summary still prints)")
    p.add_argument("--log-level", default=None, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="what the live lines on stderr show (logger `nanguard`; default "
                        "WARNING: each alarm episode as it starts and escalates, actions, "
                        "the finding; DEBUG: every alarm)")
    p.add_argument("script", help="the training script (a .py file)")
    rest = p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    rest.required = False  # argparse lists it as missing with the script: only SCRIPT is
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nanguard.run.runner import RunOptions
    from nanguard.run.runner import run as run_script

    # `not x >= 0` also refuses nan.
    for flag, value in (("--replay-budget", args.replay_budget), ("--merge-wait", args.merge_wait)):
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0 seconds, got {value:g}")
    script = Path(args.script)
    if script.is_dir():
        raise UserError(f"{args.script} is a directory, not a script: give the training "
                        "script (a .py file) to run")
    if args.out is not None:
        clear_out(Path(args.out), overwrite=args.overwrite)
    if args.fork_every < 0:
        raise ValueError(f"--fork-every must be >= 0, got {args.fork_every}")
    if args.activations_every < 0:
        raise ValueError(f"--activations-every must be >= 0, got {args.activations_every}")
    if args.rerun_every < 0:
        raise ValueError(f"--rerun-every must be >= 0, got {args.rerun_every}")
    from nanguard.show.live import ensure_handler, set_level

    set_level(args.log_level, quiet=args.quiet)
    # Now, not when the first guard is built: a line said before that (a checkpoint loaded
    # before the optimizer exists that differs from its manifest) looks like every other.
    ensure_handler()
    return run_script(RunOptions(
        script=args.script, args=list(args.args), out=args.out, policy=args.policy,
        replay_budget=args.replay_budget, fork_every=args.fork_every, merge_wait=args.merge_wait,
        preflight=args.preflight, preflight_only=args.preflight_only,
        activations_every=args.activations_every, rerun_every=args.rerun_every,
        objective=args.objective, exit_hard=True,
    ))


def clear_out(out: Path, *, overwrite: bool) -> None:
    """Refuse an --out that already holds a run (as `Guard(out=...)` does), or with
    `overwrite` remove that run's files, before the script starts. Under torchrun each rank
    looks after its own `rank-R` folder only (rank 0 after the merged report on top too), so
    no rank removes what another has begun to write."""
    from nanguard.run.run_reports import world

    rank, world_size = world()
    folder = out / f"rank-{rank}" if world_size > 1 else out
    if not folder.is_dir():
        if folder.exists():
            raise UserError(f"--out {out}: {folder} is a file, not a folder")
        return
    tops = [out / "report.json"] if world_size > 1 and rank == 0 else []
    held = [p for p in (*(folder / n for n in RUN_FILES), *tops) if p.is_file()]
    held += [p for p in [*folder.glob("optimizer-*"), *([] if world_size > 1 else
                                                       folder.glob("rank-*"))] if p.is_dir()]
    if not held:
        return
    if not overwrite:
        raise UserError(f"--out {out} already holds a run; pick another --out, or pass "
                        "--overwrite to replace it (so two runs never mix by accident)")
    for path in held:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
