"""TensorBoard exporter: a run as TensorBoard events, live while it trains or after the fact.

    from nanguard.export import tensorboard
    tensorboard.stream(guard, log_dir="runs/exp1")    # live, or writer=your SummaryWriter
    tensorboard.write_run("nanguard_runs/x")          # recorded -> nanguard_runs/x/tensorboard/
    # tensorboard --logdir runs/exp1 --samples_per_plugin scalars=0,text=0

Written, per optimizer step:

- `nanguard/<signal>` scalars (loss, grad_norm, param_norm, update_ratio, momentum_norm, act_max,
  lr) with NaN and +-Inf written as they are (TensorBoard stores them; charts leave a gap);
- `nanguard/nonfinite` (1.0 where anything watched was non-finite, else 0.0) and
  `nanguard/skipped` (1.0 where the update was discarded): finite markers that stay plotted
  where the value itself cannot be;
- text events (markdown): `nanguard/alarms` and `nanguard/actions` at each step that has any,
  `nanguard/first_nonfinite` and `nanguard/diagnosis` at the step of the first non-finite
  value, `nanguard/report` (status and every event) at the last step; live also
  `nanguard/episodes` (an episode of alarms ended: how long, how many non-finite steps).

Live, the writer is flushed at every step with an event or a non-finite value, so the NaN
step is on disk before the next step starts; other steps reach the disk every `flush_secs`.

TensorBoard keeps a sample of 1000 scalar and 10 text points per tag by default: a lone NaN step
is likely dropped from view; start it with `--samples_per_plugin scalars=0,text=0` (keep all).

Needs the `tensorboard` package (`pip install nanguard[export]`); imported only when used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from nanguard.export.common import SIGNALS, Stream, load_run, run_parts

if TYPE_CHECKING:
    from nanguard.guard import Guard

__all__ = ["SIGNALS", "TensorBoardStream", "stream", "write_run"]


def stream(guard: Guard, log_dir: str | Path | None = None, writer: Any = None,
           flush_secs: int = 10) -> TensorBoardStream:
    """Write the guard's steps and events to TensorBoard while it trains.

    Subscribes to the guard's step, event and close listeners: from the next recorded step
    on, each step's signals are scalars `nanguard/<signal>` at the guard's step and each event
    a text; the guard's `close()` writes the report and closes a writer the stream opened
    (a writer you pass stays open, flushed).

    Args:
        guard: the guard to follow (not closed).
        log_dir: where to write a new writer's event files; default `RUN/tensorboard` (the
            guard's run folder).
        writer: a `torch.utils.tensorboard.SummaryWriter` of yours to write into instead
            (your own scalars and nanguard's side by side, in one run).
        flush_secs: how often a new writer flushes steps without an event.

    Returns:
        The stream (`close()` stops it early; `writer` is the SummaryWriter).

    Raises:
        ValueError: both or (with recording off) neither of `log_dir` and `writer` given,
            or the guard is closed.
    """
    if log_dir is not None and writer is not None:
        raise ValueError("pass log_dir or writer, not both")
    if writer is None and log_dir is None:
        if guard.folder is None:
            raise ValueError("recording is off: pass log_dir= or writer= to stream to")
        log_dir = guard.folder / "tensorboard"
    return TensorBoardStream(guard, log_dir, writer, flush_secs)


class TensorBoardStream(Stream):
    """A guard streamed into a SummaryWriter (see `stream`)."""

    def __init__(self, guard: Guard, log_dir: str | Path | None, writer: Any,
                 flush_secs: int) -> None:
        self.check(guard)
        self.owned = writer is None
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(log_dir), flush_secs=flush_secs)
        self.writer = writer
        super().__init__(guard)

    def write(self, step: int, scalars: dict[str, float], texts: dict[str, str]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, text in texts.items():
            self.writer.add_text(f"nanguard/{tag}", text, step)
        if texts or scalars.get("nanguard/nonfinite"):  # what one opens TensorBoard for
            self.writer.flush()

    def finish(self, report: dict[str, Any] | None) -> None:
        if self.owned:
            self.writer.close()
        else:
            self.writer.flush()


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
