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

import json
from pathlib import Path
from typing import Any

from nanguard.record.report import REPORT_NAME
from nanguard.record.store import DB_NAME, dec, open_run

SIGNALS = ("loss", "grad_norm", "param_norm", "update_ratio", "momentum_norm", "act_max", "lr")
"""Per-step columns of run.db written as scalars (tag `nanguard/<name>`)."""


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
    folder = Path(run)
    out = Path(logdir) if logdir is not None else folder / "tensorboard"
    if not (folder / DB_NAME).exists():
        parts = sorted(p for p in folder.glob("rank-*") if (p / DB_NAME).exists())
        if not parts:
            raise ValueError(f"{str(folder)!r} is not a nanguard run folder (no {DB_NAME} in it)")
        for part in parts:
            _write_one(part, out / part.name)
        return out
    _write_one(folder, out)
    return out


def _write_one(folder: Path, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    db = open_run(folder)
    try:
        cols = ", ".join(SIGNALS)
        rows = db.execute(f"SELECT step, {cols}, nonfinite, skipped FROM steps ORDER BY step")
        steps = rows.fetchall()
    finally:
        db.close()
    report: dict[str, Any] = {}
    if (folder / REPORT_NAME).exists():
        report = json.loads((folder / REPORT_NAME).read_text())
    writer = SummaryWriter(log_dir=str(out))
    try:
        last = 0
        for row in steps:
            step = int(row[0])
            last = max(last, step)
            for name, raw in zip(SIGNALS, row[1:1 + len(SIGNALS)], strict=True):
                value = dec(raw)
                if value is not None:
                    writer.add_scalar(f"nanguard/{name}", value, step)
            flagged = json.loads(row[-2] or "[]")
            writer.add_scalar("nanguard/nonfinite", 1.0 if flagged else 0.0, step)
            writer.add_scalar("nanguard/skipped", 1.0 if row[-1] else 0.0, step)
        _write_events(writer, report, last)
    finally:
        writer.close()


def _write_events(writer: Any, report: dict[str, Any], last: int) -> None:
    by_step: dict[str, dict[int, list[str]]] = {"alarms": {}, "actions": {}}
    for a in report.get("alarms", []):
        by_step["alarms"].setdefault(int(a["step"]), []).append(
            f"- **{a['kind']}** `{a['signal']}` = {a.get('value')}: {a.get('message', '')}")
    for a in report.get("actions", []):
        by_step["actions"].setdefault(int(a["step"]), []).append(
            f"- **{a['action']}**: {a.get('detail', '')}")
    for tag, steps in by_step.items():
        for step, lines in sorted(steps.items()):
            writer.add_text(f"nanguard/{tag}", "\n".join(lines), step)
    first = report.get("first_nonfinite")
    diagnosis = report.get("diagnosis") or []
    if first:
        step = int(first.get("step", last))
        keys = ("phase", "module", "op", "source", "samples", "param", "rank", "signals")
        table = "\n".join(f"| {k} | `{first[k]}` |" for k in keys if first.get(k) is not None)
        writer.add_text("nanguard/first_nonfinite",
                        f"**first non-finite value at step {step}**\n\n| key | value |\n"
                        f"| --- | --- |\n{table}", step)
    if diagnosis:
        step = int(first["step"]) if first else last
        writer.add_text("nanguard/diagnosis", "\n".join(
            f"{i + 1}. **{c['cause']}** ({c.get('confidence', '')}): {c.get('fix', '')}"
            for i, c in enumerate(diagnosis)), step)
    if report:
        events = [f"- step {a['step']}: alarm {a['kind']}:{a['signal']}"
                  for a in report.get("alarms", [])]
        events += [f"- step {a['step']}: action {a['action']}" for a in report.get("actions", [])]
        writer.add_text("nanguard/report",
                        f"**status: {report.get('status')}**, {report.get('steps')} steps\n\n"
                        + "\n".join(events), last)

