"""TensorBoard exporter: a recorded run (run.db + report.json) as TensorBoard events.

    from nanguard.export.tensorboard import write_run
    write_run("nanguard_runs/x")                  # -> nanguard_runs/x/tensorboard/
    # tensorboard --logdir nanguard_runs/x/tensorboard --samples_per_plugin scalars=0,text=0

Written, per optimizer step:

- `nanguard/<signal>` scalars (loss, grad_norm, param_norm, update_ratio, momentum_norm, act_max,
  lr) with NaN and +-Inf written as they are (TensorBoard stores them; charts leave a gap);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite markers that stay plotted
  where the value itself cannot be;
- text events (markdown): `nanguard/alarms` and `nanguard/actions` at each step that has any,
  `nanguard/first_nonfinite` and `nanguard/diagnosis` at the step of the first non-finite
  value, `nanguard/report` (status and every event) at the last step.

TensorBoard keeps a sample of 1000 scalar and 10 text points per tag by default: a lone NaN step
is likely dropped from view; start it with `--samples_per_plugin scalars=0,text=0` (keep all).

Needs the `tensorboard` package (`pip install nanguard[export]`); imported only when used.
"""

from __future__ import annotations

from pathlib import Path

from nanguard.export._common import SIGNALS, load_run, run_parts

__all__ = ["SIGNALS", "write_run"]


def write_run(run: str | Path, logdir: str | Path | None = None) -> Path:
    """Write a run folder's steps and events as TensorBoard events.

    A folder merged from ranks (`rank-R/` subfolders, no run.db of its own) is written one
    subfolder per rank, so TensorBoard shows the ranks as separate runs.

    Args:
        run: the run folder (holds run.db; report.json when the guard was closed).
        logdir: where to write; default `RUN/tensorboard`.

    Returns:
        The log directory written.

    Raises:
        ValueError: `run` is not a nanguard run folder.
    """
    out = Path(logdir) if logdir is not None else Path(run) / "tensorboard"
    for name, folder in run_parts(run):
        _write_one(folder, out if name is None else out / name)
    return out


def _write_one(folder: Path, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    data = load_run(folder)
    writer = SummaryWriter(log_dir=str(out))
    try:
        for row in data.steps:
            for tag, value in row.scalars().items():
                writer.add_scalar(tag, value, row.step)
        for event in data.events:
            writer.add_text(f"nanguard/{event.tag}", event.text, event.step)
    finally:
        writer.close()
