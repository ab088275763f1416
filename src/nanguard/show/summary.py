"""The terminal summary printed when a guarded run ends (and by `nanguard report`).

By default it fits a screen (`BUDGET` lines at the console's width): the status, the first
non-finite value (step, phase, op, the user's line), the lead time of the first warning, the
cause with its fix, one line each for the other causes, spikes, alarms and actions, the steps
as sparklines, and the commands to run next. What does not fit is cut and says so, with the
count; `full=True` (`nanguard report RUN --full`) prints every cause, the alarms and actions
as tables and the last steps as numbers. Printed once, after the run; never while training.
"""

from __future__ import annotations

import shlex
import textwrap
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.text import Text

from nanguard.record.report import Report
from nanguard.show.spike_lines import heal_line, report_spike_line, spike_line
from nanguard.show.tables import (
    LAST,
    SERIES,
    print_alarms,
    print_last_steps,
    series_lines,
    sparkline,
    step_row,
    steps_title,
)
from nanguard.watch.stats import StepStats

__all__ = ["BUDGET", "SERIES", "first_where", "heal_line", "headline", "parts_shown",
           "print_last_steps", "print_summary", "report_spike_line", "sparkline", "spike_line",
           "step_row"]

BUDGET = 25
"""Lines the default summary may take at the console's width."""
SAMPLES = 8
"""Sample indices shown of the first non-finite value (the rest are in report.json)."""

_STATUS_STYLE = {"healthy": "green", "warned": "yellow", "failed": "red", "recovered": "cyan",
                 "crashed": "red", "degraded": "magenta", "unwatched": "magenta",
                 "interrupted": "yellow", "died": "red", "running": "blue"}

_STEPPED_OVER = {
    "GradScaler": "the GradScaler skipped that step: no update used it",
    "script": "no update used it: the step's loss, gradients and parameters stayed finite "
              "(the forward that held it was stepped over: your own non-finite check, or "
              "an evaluation pass)",
}
"""What `first_nonfinite.skipped_by` means for the run, said under the finding."""


def _stepped_over(first: Mapping[str, Any]) -> str | None:
    """What `first_nonfinite.skipped_by` means for this finding. A forward op's value that
    the step's re-run under the op checker saw flow into no later non-finite value (no
    `propagated_by`) was not stepped over by the script: it never left the forward (makemore's
    RNN at `--learning-rate 1000`: `xh_to_h` overflowed, its `tanh` read the inf as 1)."""
    how = first.get("skipped_by")
    if (how == "script" and first.get("kind") == "op" and first.get("phase") == "forward"
            and not first.get("propagated_by")):
        op = f"`{first['module']}`" if first.get("module") else "it"
        return ("no update used it: the step's loss, gradients and parameters stayed "
                f"finite; its re-run saw an op after {op} bound the value (a tanh or clamp "
                "reads an inf as finite) or nothing read it")
    return _STEPPED_OVER.get(str(how)) if how else None


def _read_every(report: Report, first: Mapping[str, Any]) -> str | None:
    """A finding seen in activations alone, which are read every k steps (`sampling`): the
    value may have begun between two reads (a tanh RNN at `--learning-rate 1000`: its cell
    overflowed at step 18, first read at 20). None when activations are read every step."""
    every = ((report.sampling or {}).get("signals") or {}).get("activations")
    if first.get("signals") != ["activation"] or not isinstance(every, int) or every <= 1:
        return None
    return (f"activations are read every {every} steps: it may have begun up to {every - 1} "
            "steps earlier")


def headline(report: Report) -> str:
    """`failed after 12 steps`; a failure before any update says so instead of reading like a
    crash (`failed: non-finite at step 0, before any update`)."""
    first = report.first_nonfinite
    if report.status == "failed" and first and report.steps == 0:
        return f"{report.status}: non-finite at step {first.get('step', 0)}, before any update"
    if report.status == "unwatched":
        return f"{report.status}: no training step was watched"
    if report.status == "running":
        seen = f", {len(report.alarms)} alarm(s) so far" if report.alarms else ""
        bad = "; non-finite values seen" if first else ""
        return f"running: {report.steps} step{'' if report.steps == 1 else 's'} recorded{seen}{bad}"
    return f"{report.status} after {report.steps} step{'' if report.steps == 1 else 's'}"


def print_summary(
    report: Report,
    history: Sequence[StepStats] = (),
    console: Console | None = None,
    *,
    parts_history: Mapping[str, Sequence[StepStats]] | None = None,
    rows: Sequence[dict[str, Any]] | None = None,
    parts_rows: Mapping[str, Sequence[dict[str, Any]]] | None = None,
    full: bool = False,
) -> None:
    """Print the summary of a run that has ended (or is still running, for `nanguard report`).

    Args:
        report: the report (a merged one for several optimizers or ranks).
        history: the steps of the part that failed (or of the only part).
        console: where to print; stderr by default.
        parts_history: for a merged report, each part's last steps by part label: one block
            per part instead of `history`.
        rows: the steps as `step_row` dicts, when read from a run folder instead of `history`.
        parts_rows: each part's steps as such dicts (`nanguard report` of a merged run),
            instead of `parts_history`.
        full: every cause, the alarms and actions as tables, the last steps as numbers.
    """
    console = console or Console(stderr=True)
    parts = {label: [step_row(s) for s in steps]
             for label, steps in (parts_history or {}).items() if steps}
    parts.update({label: list(r) for label, r in (parts_rows or {}).items() if r})
    own = list(rows) if rows is not None else [step_row(s) for s in history]
    if full:
        _print_full(console, report, parts, own)
        return
    for line in compact_lines(report, parts, own, max(40, console.width)):
        console.print(line, soft_wrap=True)


def parts_shown(run: Mapping[str, Any], labels: Sequence[str], failing: str | None
                ) -> list[str]:
    """The parts of a merged run whose steps the summary shows: every one of `labels` but,
    of optimizers built one after the other over the same parameters (a chain, report.json
    `run.optimizer_chains`), the earlier ones, which are the same training's earlier steps;
    the failing part always."""
    earlier = {name for chain in run.get("optimizer_chains") or [] for name in chain[:-1]}
    return [label for label in labels if label == failing or label not in earlier]


def _status_line(report: Report, width: int | None = None) -> Text:
    """`nanguard: failed after 12 steps — record in DIR`; where that is wider than `width`,
    the record's folder goes on a line of its own."""
    status, _, rest = headline(report).partition(report.status)
    folder = report.run.get("folder")
    text = Text("nanguard", style="bold")
    text.append(f": {status}")
    text.append(report.status, style=_STATUS_STYLE.get(report.status, "white"))
    text.append(rest)
    if folder:
        where = f" — record in {folder}"
        fits = width is None or len(text) + len(where) <= width
        text.append(where if fits else f"\n  record in {folder}")
    return text


# Ops that adopt memory made elsewhere (pinpoint/op_kinds.py ADOPT_OPS): in the data phase the
# value was not computed by this process, so the op's name alone reads like a culprit.
_ADOPTED = {"aten.set_": "it arrived with a DataLoader worker's batch",
            "aten.from_file": "it was read from a mapped file"}


def first_where(first: Mapping[str, Any]) -> str:
    """`phase data, module fc1, op aten.log`: where the first non-finite value was made; for
    a value the data phase adopted (a worker's batch), how it arrived instead of the op."""
    parts = []
    for k in ("phase", "module", "op"):
        v = first.get(k)
        if v in (None, ""):
            continue
        if k == "op" and first.get("phase") == "data" and v in _ADOPTED:
            parts.append(f"op {v}: {_ADOPTED[v]}")
        else:
            parts.append(f"{k} {v}")
    return ", ".join(parts)


def _first_text(first: dict[str, Any]) -> str:
    where = first_where(first)
    part = f" in {first['part']}" if first.get("part") else ""
    samples = [str(s) for s in first.get("samples") or []]
    cut = f" ({SAMPLES} of {len(samples)})" if len(samples) > SAMPLES else ""
    return (f"first non-finite at step {first['step']}{part}" + (f" ({where})" if where else "")
            + f"; in: {', '.join(first.get('signals') or []) or '?'}"
            + (f"; samples {', '.join(samples[:SAMPLES])}{cut}" if samples else ""))


def _lead_text(report: Report) -> str:
    if report.first_warning is None:
        step = (report.first_nonfinite or {}).get("step")
        with_it = sorted({str(a["kind"]) for a in report.alarms
                          if a["step"] == step and a["kind"] != "nonfinite"})
        if with_it:  # at the NaN's own step: they came with it, not before it (record.lead)
            return (f"no warning came before it: {', '.join(with_it)} came at its own step "
                    f"{step}, with the non-finite value")
        return "no warning came before it: the first alarm was the non-finite value itself"
    return (f"first warning at step {report.first_warning}: {report.lead_steps} steps before "
            "the first non-finite value")


def _count_text(items: Sequence[dict[str, Any]], noun: str, key: str) -> str:
    steps = sorted({int(a["step"]) for a in items})
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    kinds = Counter(str(a[key]) for a in items)
    return (f"{noun}: {len(items)} at {span} ("
            + ", ".join(f"{k} {n}" for k, n in kinds.most_common()) + ")")


class _Block:
    """Lines of the compact summary that belong together; `wrap` lays a text out at the
    console's width with a hanging indent, cutting it at `cap` lines with an ellipsis."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.lines: list[Text] = []

    def wrap(self, text: str, indent: int = 2, *, label: str = "", style: str = "",
             cap: int | None = None, hang: int = 2) -> bool:
        """Add `text`; returns False when it was cut at `cap` lines."""
        lines = textwrap.wrap(text, self.width, initial_indent=" " * indent,
                              subsequent_indent=" " * (indent + hang), break_on_hyphens=False)
        lines = lines or [" " * indent]
        whole = cap is None or len(lines) <= cap
        if not whole:
            assert cap is not None
            lines = lines[:cap]
            lines[-1] = lines[-1][: self.width - 1].rstrip() + "…"
        for i, line in enumerate(lines):
            t = Text(line)
            if i == 0 and label and style:
                t.stylize(style, indent, indent + len(label))
            self.lines.append(t)
        return whole


def compact_lines(report: Report, parts: Mapping[str, Sequence[dict[str, Any]]],
                  rows: Sequence[dict[str, Any]], width: int) -> list[Text]:
    """The default summary, at most `BUDGET` lines at `width` columns (more only when the
    essentials alone take more: the cause's fix is never cut below what fits)."""
    first = report.first_nonfinite
    folder = report.run.get("folder")
    run = shlex.quote(str(folder)) if folder else None
    finding = _Block(width)
    if first:
        finding.wrap(_first_text(first), label="first non-finite", style="red", cap=3)
        if first.get("source"):
            finding.wrap(f"at {first['source']}", 4, cap=2)
        if (over := _stepped_over(first)) is not None:
            finding.wrap(over, 4, cap=3)
        if (every := _read_every(report, first)) is not None:
            finding.wrap(every, 4, cap=2)
        finding.wrap(_lead_text(report), cap=2)
    cause = report.diagnosis[0] if report.diagnosis else None
    named, why, fix = _Block(width), _Block(width), _Block(width)
    if cause:
        label = f"cause: {cause['cause']}"
        named.wrap(f"{label} ({cause['confidence']:.0%})", label=label, style="bold", cap=2)
        fix.wrap(f"fix: {cause['fix']}", 4, cap=8, hang=5)
    nxt = _next_block(report, run, width)
    head = _status_line(report, width)
    budget = BUDGET - len(head.split()) - sum(len(b.lines) for b in (finding, named, fix, nxt))
    # What else is shown, most telling first, while lines are left.
    if cause:
        why.wrap(f"why: {cause['evidence']}", 4, cap=max(1, min(4, budget)), hang=5)
        budget -= len(why.lines)
    extra: list[Text] = []
    for text in _extra_texts(report, run):
        block = _Block(width)
        block.wrap(text, cap=2)
        if len(block.lines) <= budget:
            extra += block.lines
            budget -= len(block.lines)
    steps = _steps_block(report, parts, rows, width, budget)
    return [head, *finding.lines, *named.lines, *why.lines, *fix.lines, *extra,
            *steps.lines, *nxt.lines]


def _extra_texts(report: Report, run: str | None) -> list[str]:
    """The optional one-liners (each wrapped to at most two lines), in the order shown."""
    out: list[str] = []
    others = report.diagnosis[1:]
    if others:
        where = " (each with its why and fix: --full)" if run else ""
        out.append("also possible: " + ", ".join(
            f"{c['cause']} ({c['confidence']:.0%})" for c in others) + where)
    line = report_spike_line(report)
    if line:
        out.append(line)
    heal = heal_line(report)
    if heal:
        out.append(heal)
    if report.actions:
        out.append(_count_text(report.actions, "actions", "action"))
    if report.alarms:
        text = _count_text(report.alarms, "alarms", "kind")
        if not report.first_nonfinite:  # no finding above: the first alarm says what it was
            a = report.alarms[0]
            text += f"; first: step {a['step']} {a['signal']}: {a['message']}"
        out.append(text)
    return out


def _steps_block(report: Report, parts: Mapping[str, Sequence[dict[str, Any]]],
                 rows: Sequence[dict[str, Any]], width: int, budget: int) -> _Block:
    """Sparklines of the last steps (each part's, the failing part first, when there are
    several), as many series as the lines left allow; nothing when not even one fits."""
    block = _Block(width)
    shown = {"": list(rows)[-LAST:]} if rows and not parts else {
        label: list(r)[-LAST:] for label, r in parts.items()}
    if not shown:
        return block
    first = report.first_nonfinite or {}
    failing = first.get("part")
    order = sorted(shown, key=lambda label: label != failing)
    # Each part's history stops at its own first non-finite value; only the failing part's
    # title can say where.
    title_step = {label: first.get("step") if label in ("", failing) or not failing else None
                  for label in order}
    # Fewer series, then fewer parts; at the least each part's title line (which names it).
    tries = [(order, SERIES), (order, SERIES[:2]), (order[:2], SERIES[:2]),
             (order[:1], SERIES[:2]), (order[:1], SERIES[:1]), (order, ())]
    for labels, keys in tries:
        lines: list[Text] = []
        for label in labels:
            sub = _Block(width)
            title = steps_title(shown[label], title_step[label])
            sub.wrap((f"{_part_name(report, label)}: " if label else "")
                     + f"{title}; log scale, ! = non-finite:", cap=2)
            lines += sub.lines + [Text(s) for s in series_lines(shown[label], keys)]
        if len(lines) <= budget:
            block.lines = lines
            return block
    return block


def _part_name(report: Report, label: str) -> str:
    """`optimizer-1 (Generator, Adam)`: a part of a merged run with its model and optimizer."""
    what = (report.run.get("parts") or {}).get(label, {})
    desc = ", ".join(str(what[k]) for k in ("model", "optimizer") if what.get(k))
    return label + (f" ({desc})" if desc else "")


def _next_block(report: Report, run: str | None, width: int) -> _Block:
    """The commands to run next: the HTML report, the replay of the failing step (where the
    run says how to run it again: one script under `nanguard run`) and the full tables."""
    block = _Block(width)
    if run is None:
        return block
    cmds = [(f"nanguard report {run} --html", "every step and alarm, in a browser")]
    if (report.first_nonfinite and report.run.get("entry") == "run"
            and not report.run.get("parts")):
        cmds.append((f"nanguard replay {run}", "the failing step again, op by op"))
    cmds.append((f"nanguard report {run} --full", "the full summary and tables, here"))
    pad = max(len(c) for c, _ in cmds)
    # What each does, where every line has room for it.
    said = all(8 + pad + 2 + len(what) <= width for _, what in cmds)
    for i, (cmd, what) in enumerate(cmds):
        lead = "  next: " if i == 0 else " " * 8
        text = Text(f"{lead}{cmd:<{pad}}  {what}" if said else f"{lead}{cmd}")
        if i == 0:
            text.stylize("bold", 2, 6)
        block.lines.append(text)
    return block


def _plain(console: Console, text: str) -> None:
    """Print text as it is: a path or a fix may hold brackets, never markup."""
    console.print(text, markup=False, highlight=False)


def _print_full(console: Console, report: Report, parts: Mapping[str, Sequence[dict[str, Any]]],
                rows: Sequence[dict[str, Any]]) -> None:
    """Every cause with its evidence and fix, the alarms and actions as tables, the last
    steps as sparklines and numbers (each part's for a merged report)."""
    console.print(_status_line(report))
    first = report.first_nonfinite
    if first:
        _plain(console, f"  {_first_text(first)}")
        if first.get("source"):
            _plain(console, f"    at {first['source']}")
        if (over := _stepped_over(first)) is not None:
            _plain(console, f"    {over}")
        if (every := _read_every(report, first)) is not None:
            _plain(console, f"    {every}")
        _plain(console, f"  {_lead_text(report)}")
    for rank, cause in enumerate(report.diagnosis, 1):
        _plain(console, f"  cause {rank}: {cause['cause']} ({cause['confidence']:.0%})")
        _plain(console, f"    why: {cause['evidence']}")
        _plain(console, f"    fix: {cause['fix']}")
    for line in (report_spike_line(report), heal_line(report), sampling_line(report)):
        if line:
            _plain(console, f"  {line}")
    print_alarms(console, report)
    first_step = first["step"] if first else None
    if parts:
        for label, steps in parts.items():
            _plain(console, f"  {_part_name(report, label)}:")
            print_last_steps(console, steps, first_step)
    elif rows:
        print_last_steps(console, rows, first_step)


def sampling_line(report: Report) -> str | None:
    """`sampled: optimizer state every 10 steps (+ 3 more: alarm 2, close 1), update ratio
    every 10; every step: loss, grad_norms, ...` from report.json's `sampling`; None for a
    report without it (rebuilt from run.db, or older)."""
    s = report.sampling
    if not s:
        return None
    names = {"optimizer_state": "optimizer state", "update_ratio": "update ratio",
             "activations": "activations"}
    parts = []
    for key, every in (s.get("signals") or {}).items():
        if not every:
            continue
        text = f"{names.get(key, key)} every {every} steps"
        if key == "optimizer_state":
            why = {k: n for k, n in (s.get("state_why") or {}).items() if n and k != "stride"}
            if why:
                text += (f" (+ {sum(why.values())} more: "
                         + ", ".join(f"{k} {n}" for k, n in why.items()) + ")")
        parts.append(text)
    every_step = ", ".join(s.get("every_step") or [])
    return (f"sampled: {'; '.join(parts) or 'nothing'}"
            + (f"; every step: {every_step}" if every_step else ""))
