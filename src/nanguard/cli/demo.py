"""`nanguard demo`: the LR/momentum cascade on CPU, over several seeds, in under a minute.

For each seed it trains the scenario of `nanguard.scenarios.cascade` under a guard (policy
`observe`, recording to DIR/seed-N), then shows when the first warning came, when the first
non-finite value appeared (the lead time), where it showed, and what the `raise`, `skip` and
`rollback` policies do on the same seed (`skip` configured to escalate to a rollback when
skipping cannot heal; in Python, `RecoverConfig(skip_escalation="rollback")`).

Run it again into the same folder and the seed folders of the earlier run are replaced.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import textwrap
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from nanguard.cli.main import add_command, add_json, wants_json
from nanguard.errors import NanguardError
from nanguard.show.progress import waiting

if TYPE_CHECKING:
    from nanguard.guard import Guard
    from nanguard.record.report import Report

# Policies compared on failing seeds. `skip` acts on the early warnings too, so it can step
# around the spike that starts the cascade instead of waiting for the NaN.


def register(subparsers: argparse._SubParsersAction) -> None:
    p = add_command(
        subparsers,
        "demo",
        help="watch the LR/momentum cascade fail on several seeds, with lead times",
        description=__doc__,
        ok="the demo ran (its failing seeds are what it shows, not an error)",
        one="not used",
    )
    p.add_argument(
        "--out",
        default="nanguard_demo",
        help="folder for the run folders (default: ./nanguard_demo)",
    )
    p.add_argument("--seeds", type=int, default=10, help="number of seeds (default 10)")
    p.add_argument("--steps", type=int, default=300, help="steps per seed (default 300)")
    add_json(p, "one record per seed (status, steps of the first warning and the first "
             "non-finite value, lead, where, what each policy did)")
    p.set_defaults(func=run)


def _train(
    seed: int,
    steps: int,
    folder: Path,
    policy: str = "observe",
    act_on: tuple[str, ...] | None = None,
) -> tuple[Report, list[float]]:
    """Train one seed of the cascade under a recording guard; return its report and losses.
    A run folder left by an earlier demo is replaced (the demo's folders are its own)."""
    # torch is imported here, not at the top: `nanguard --help` builds every parser.
    from torch.nn.functional import mse_loss

    from nanguard.config import GuardConfig, RecordConfig, RecoverConfig
    from nanguard.guard import Guard
    from nanguard.scenarios.cascade import step_loss, train_cascade

    guards: list[Guard] = []

    def factory(model: Any, optimizer: Any) -> Guard:
        config = GuardConfig(act_on=act_on,
                             record=RecordConfig(summary=False, if_exists="overwrite"),
                             recover=RecoverConfig(skip_escalation="rollback"))

        def replay(batch: Any) -> Any:  # the step's forward and loss, for the op-level replay
            # The scenario's own function, as training calls it: the op found is named on
            # the scenario's line, as a re-run of the scenario names it.
            return step_loss(model, mse_loss, batch)

        guards.append(
            Guard(
                model,
                optimizer,
                policy=policy,
                out=str(folder),
                activations=True,
                replay=replay,
                config=config,
            )
        )
        # How to run it again, for `nanguard replay`.
        guards[0].store.write_meta(scenario={"name": "cascade", "seed": seed, "steps": steps})
        return guards[0]

    _, losses = train_cascade(seed, factory, steps=steps)
    report = guards[0].report
    assert report is not None, "train_cascade closes the guard"
    return report, losses


TAIL = 20  # the final loss: the mean of the last TAIL steps (one batch is noisy)


def _final(losses: list[float]) -> float:
    tail = losses[-TAIL:]
    return sum(tail) / len(tail)


def _policy_outcomes(seed: int, steps: int, out: Path) -> tuple[str, list[tuple[str, float]]]:
    """Run a failing seed again under `raise`, `skip` and `rollback`; say what happened: the
    `raise` outcome, then per recovering policy a cell and its final loss (NaN: gave up)."""
    try:
        _train(seed, steps, out / f"seed-{seed}-raise", "raise")
        raised = "no stop"
    except NanguardError as exc:
        first = exc.report.first_nonfinite
        raised = f"stop@{first['step']}" if first else "stops"
    outcomes: list[tuple[str, float]] = []
    for policy in ("skip", "rollback"):
        try:
            report, losses = _train(seed, steps, out / f"seed-{seed}-{policy}", policy)
            k = sum(1 for a in report.actions if a["action"] == "skip")
            n = sum(1 for a in report.actions if a["action"] == "rollback")
            final = _final(losses)
            outcomes.append((f"{k}s {n}r -> {final:.2g}", final))
        except NanguardError as exc:
            # Never a loop: when recovering cannot heal, the policy gives up with the report.
            step = next((a["step"] for a in exc.report.actions if a["action"] == "give_up"),
                        None)
            outcomes.append((f"gave up@{step}", math.nan))
    return raised, outcomes


def _seed_record(seed: int, folder: Path, report: Report, raised: str | None,
                 outcomes: list[tuple[str, float]]) -> dict[str, Any]:
    """One seed's row of `--json`: what the table shows, as data."""
    first = report.first_nonfinite
    record: dict[str, Any] = {
        "seed": seed, "folder": str(folder), "status": report.status,
        "first_warning": report.first_warning, "lead_steps": report.lead_steps,
        "first_nonfinite": None if first is None else
        {k: first.get(k) for k in ("step", "phase", "module", "op")},
    }
    if raised is not None:
        record["raise"] = raised
        for policy, (cell, final) in zip(("skip", "rollback"), outcomes, strict=True):
            record[policy] = {"outcome": cell, "final_loss": None if math.isnan(final)
                              else final}
    return record


def run(args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from nanguard.show.live import muted

    if args.seeds < 1 or args.steps < 10:
        raise ValueError("--seeds must be >= 1 and --steps >= 10")
    out = Path(args.out)
    as_json = wants_json(args)
    # --json: stdout holds the JSON alone; the progress line still goes to stderr.
    console = Console(quiet=as_json)
    if not console.is_terminal:  # piped or captured: don't squeeze the table into 80 columns
        console = Console(width=130, quiet=as_json)
    console.print(
        "[bold]nanguard demo[/]: MLP + LeakyReLU(0.01), SGD momentum 0.9, lr 0.05; a rare "
        f"outlier sample may start a cascade. {args.seeds} seeds x {args.steps} steps, "
        f"records in {out}/"
    )
    # Under 118 columns the `where` column goes (the diagnosis below says where), so the
    # table fits 80 columns instead of being cropped into ellipses.
    wide = console.width >= 118
    table = (Table(show_edge=False) if wide else
             Table(show_edge=False, box=box.SIMPLE_HEAD, padding=(0, 1, 0, 0)))
    for col in ("seed", "status", "warn@", "nan@", "lead",
                *(["where (phase:module:op)"] if wide else []), "raise", "skip", "rollback"):
        table.add_column(col, no_wrap=True)
    leads: list[int] = []
    failed = 0
    example: tuple[int, Report] | None = None  # the first failing seed, explained below
    healthy: list[float] = []  # final losses of the seeds that never failed
    recovered: list[float] = []  # ...and of the failing ones under skip and rollback
    records: list[dict[str, Any]] = []
    what = (f"training {args.seeds} seeds x {args.steps} steps (each failing one again under "
            "raise, skip and rollback)")
    with muted(), waiting(what, total=args.seeds, unit="seeds") as tick:
        for seed in range(args.seeds):
            tick(seed)
            report, losses = _train(seed, args.steps, out / f"seed-{seed}")
            first = report.first_nonfinite
            if first is None:
                healthy.append(_final(losses))
                records.append(_seed_record(seed, out / f"seed-{seed}", report, None, []))
                warn = "-" if report.first_warning is None else str(report.first_warning)
                table.add_row(str(seed), report.status, warn, *["-"] * (6 if wide else 5))
                continue
            failed += 1
            example = example or (seed, report)
            if report.lead_steps is not None:
                leads.append(report.lead_steps)
            raised, outcomes = _policy_outcomes(seed, args.steps, out)
            recovered += [final for _, final in outcomes]
            records.append(_seed_record(seed, out / f"seed-{seed}", report, raised, outcomes))
            table.add_row(
                str(seed),
                f"[red]{report.status}[/]",
                "-" if report.first_warning is None else str(report.first_warning),
                str(first["step"]),
                "-" if report.lead_steps is None else f"[bold]{report.lead_steps}[/]",
                *([":".join(
                    str(first.get(k) or "").replace("aten.", "") for k in ("phase", "module", "op")
                ).rstrip(":")] if wide else []),
                raised,
                *(cell for cell, _ in outcomes),
            )
    if as_json:
        print(json.dumps(records, indent=2))
        return 0
    console.print(table)
    console.print(
        "warn@ / nan@: steps of the first warning and the first non-finite value; lead: steps "
        "between them;" + (" where: where it first showed;" if wide else "")
        + " raise / skip / rollback: the same seed under that policy (updates skipped s, "
        "rollbacks r -> final loss)."
    )
    if failed:
        console.print(
            f"{failed} of {args.seeds} seeds hit a non-finite value; the first warning came "
            f"a median of {median(leads) if leads else 0:g} steps before it "
            f"({sum(1 for x in leads if x >= 3)} of {failed} seeds warned >= 3 steps ahead)."
        )
        if healthy:
            low, high = min(healthy), max(healthy)
            healed = sum(1 for v in recovered if low <= v <= high)
            console.print(
                f"Healed: {healed} of {len(recovered)} skip/rollback runs of the failing seeds "
                f"end with a final loss (mean of the last {TAIL} steps) within the range of the "
                f"{len(healthy)} seeds that never failed, [{low:.2g}, {high:.2g}]."
            )
    else:
        console.print(f"none of {args.seeds} seeds failed; try --seeds 20")
    if example and example[1].diagnosis:
        seed, report = example
        cause = report.diagnosis[0]
        first = report.first_nonfinite or {}
        where = ", ".join(f"{k} {first[k]}" for k in ("phase", "module", "op") if first.get(k))
        console.print(f"\n[bold]Diagnosis of seed {seed}[/]: {cause['cause']} "
                      f"({cause['confidence']:.0%}); first non-finite at step "
                      f"{first.get('step')}" + (f" ({where})" if where else ""))
        # The why is cut at 3 lines (`nanguard report ... --full` has it whole); the fix never.
        for label, text, cap in (("why", cause["evidence"], 3), ("fix", cause["fix"], None)):
            lines = textwrap.wrap(f"{label}: {text}", max(40, console.width),
                                  initial_indent="  ", subsequent_indent="       ")
            if cap is not None and len(lines) > cap:
                lines = [*lines[:cap - 1], lines[cap - 1][: console.width - 1].rstrip() + "…"]
            for line in lines:
                console.print(line, markup=False, highlight=False)
    console.print(f"Each run folder holds run.db and report.json: `nanguard report "
                  f"{out}/seed-N [--full]` prints one.")
    if example:
        # The last line: the picture of a failing seed (plots over steps, the NaN marked).
        folder = shlex.quote(str(out / f"seed-{example[0]}"))
        console.print(f"See failing seed {example[0]} in a browser: nanguard report {folder} "
                      f"--html  (writes {folder}/report.html)", soft_wrap=True, markup=False,
                      highlight=False)
    return 0
