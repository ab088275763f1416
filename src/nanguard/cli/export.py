"""`nanguard export RUN --to tensorboard|wandb|mlflow|trackio [--dest D]`: write a recorded run
(run.db + report.json) into an experiment tracker, NaN/Inf steps kept and marked.

Where it goes, per tracker (`--dest` overrides; a W&B or MLflow run is always a new one here):

  tensorboard  event files in RUN/tensorboard            (--dest: the log dir)
  wandb        a run, WANDB_MODE / WANDB_PROJECT honoured, files under WANDB_DIR, else RUN
                                                          (--dest: the folder for wandb/)
  mlflow       a run in MLFLOW_TRACKING_URI, else the file store RUN/mlruns
                                                          (--dest: a tracking URI or a folder)
  trackio      a run in trackio's local store (TRACKIO_DIR)   (--dest: the store folder)

For a run still training, stream it instead: `nanguard.export.<tracker>.stream(guard)`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from nanguard.cli.main import UserError, add_command
from nanguard.export.common import run_parts

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
# The package each tracker needs, as `pip install nanguard[extra]` names it.
EXTRAS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers, "export", ok="the run was written into the tracker",
        one="not used (a tracker that fails to write is an error: 2 or 3)",
        help="write a recorded run into TensorBoard, W&B, MLflow or trackio",
        description=__doc__)
    p.add_argument("run", help="a run folder (holds run.db), or one merged from ranks")
    p.add_argument("--to", required=True, choices=TRACKERS, help="the tracker")
    p.add_argument("--dest", default=None, help="where to write (see above)")
    p.add_argument("--project", default=None,
                   help="W&B / trackio project or MLflow experiment (default: the tracker's "
                   "environment, else 'nanguard')")
    p.add_argument("--name", default=None, help="tracker run name (default: the folder name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.run)
    if not folder.is_dir():
        raise UserError(f"{args.run}: no such run folder")
    run_parts(folder)  # not a run folder: one line, before any tracker is imported
    try:
        written = _export(args, folder)
    except ImportError as exc:
        raise UserError(f"--to {args.to} needs {exc.name or 'its tracker package'}: "
                        f"pip install 'nanguard[{EXTRAS[args.to]}]'") from exc
    except Exception as exc:
        if not _needs_login(exc):
            raise
        what = " ".join(str(exc).split())
        raise UserError(f"--to wandb: W&B needs a login here ({what}): run `wandb login` "
                        "or set WANDB_API_KEY, or write the run offline with "
                        "WANDB_MODE=offline (then `wandb sync` uploads it)") from exc
    for where in written:
        print(f"nanguard export: {args.to}: {where}")
    return 0


def _needs_login(exc: BaseException) -> bool:
    """W&B refusing to start a run for want of a login (no API key, a key it rejects): the
    user's setup, not a bug. Told by the class W&B raises, without importing wandb."""
    return (type(exc).__module__.startswith("wandb")
            and type(exc).__name__ in ("UsageError", "AuthenticationError"))


def _export(args: argparse.Namespace, folder: Path) -> list[Any]:
    if args.to == "tensorboard":
        from nanguard.export import tensorboard

        return [tensorboard.write_run(folder, args.dest)]
    if args.to == "wandb":
        from nanguard.export import wandb

        return wandb.write_run(folder, project=args.project, name=args.name, dir=args.dest)
    if args.to == "mlflow":
        from nanguard.export import mlflow

        uri = args.dest
        if uri is not None and "://" not in uri:  # a folder: its file store
            uri = Path(uri).resolve().as_uri()
        ids = mlflow.write_run(folder, tracking_uri=uri, experiment=args.project,
                               run_name=args.name)
        return [f"run {rid}" for rid in ids]
    from nanguard.export import trackio

    return [f"run {name}" for name in trackio.write_run(
        folder, project=args.project or "nanguard", name=args.name, dir=args.dest)]
