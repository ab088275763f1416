"""Loss spikes whose cause is not the optimizer, and what each remedy does about them (issue 40
item 6; DESIGN.md section 5 "spikes").

The small GPT of benchmarks/spiky_lm.py (2 layers, d_model 32, 2 heads, context 16, vocab 64,
a sparse random Markov chain as its "text"), AdamW (betas 0.9 / 0.99, weight decay 0.1), a
linear warm-up over `--warmup` steps, `--steps` steps of `--batch` fresh sequences, with one
cause of spikes planted per run, through the loader or the schedule (`_spike_plant.py`):

    bad       at `--bad` steps the loader fills `--rows` rows (at random positions) of the batch
              from a corrupted region: one symbol repeated, random bytes, the text under the
              wrong code table, in turn. Base LR `--lr`.
    jump      the schedule jumps `--factor` x at `--jump-at`, without warm-up: 0.01 -> 0.1, an
              LR at the edge of stability on this model by itself (below), so two causes at
              once: the jump, and the LR it goes to.
    jump_held the schedule jumps `--held-factor` x at `--jump-at` from `--held-lr`, without
              warm-up, to an LR a warmed-up run holds: 0.001 -> 0.05, the jump alone.
    resume    the run is saved at `--jump-at` (model, optimizer, the loader's position, ZClip's
              statistics, `Guard.state_dict()`), and resumed by fresh objects at `--factor` x
              the LR, with no warm-up.
    lr_wd     spiky_lm.py's cause: LR `--wd-lr` (0.1) x weight decay 0.1, no other fault; run
              for `--wd-steps` (1200) steps: its first spike comes after ~700.

Why the two jumps (measured with this script, plain training, 600 steps, from step 200;
BENCHMARKS.md "The jump's target LR"): a run warmed up (50 steps) to 0.1 from the start, no
jump (`--causes lr_wd --wd-lr 0.1 --wd-steps 600 --configs plain --seeds 0,1,2`), spikes on its
own: 0 / 1 / 1 episodes (0% / 3.0% / 5.75% of steps in spike); warmed up to 0.05 or 0.07 it has
none on any of the three seeds (peak loss 1.25-1.35). A jump without warm-up to such an LR
spikes little: 0.01 -> 0.07 (7x, seeds 0-2) and 0.005 -> 0.05 (10x, seeds 0-1) no episode,
peak 1.34-1.40; 0.01 -> 0.05 (5x) one one-step episode on seed 1 of 0-1; 0.001 -> 0.05 (50x,
seeds 0-2) no episode of the independent count, one of OLMo's each (1.75-3% of steps), peak
1.59-1.63. Against 0.01 -> 0.1: 28-67% of steps in spike, peak 5.2-6.8. So `jump` is a jump
to an LR at the edge (the jump makes the edge's spikes come at once and far larger), and
`jump_held` the largest jump to a held LR that still spikes by OLMo's measure.

and each remedy, on the same seed, data and initial weights:

    plain     nothing
    clip      clip_grad_norm_(1.0)
    zclip     ZClip (spiky_lm.ZClip: EMA mean / variance of the grad norm, z 2.5, reciprocal
              clipping; its statistics saved with the checkpoint)
    observe, skip, rollback, heal
              nanguard.Guard(policy=...), `watch(loss=..., batch=(x, y))` every step and
              `replay=` (the forward and loss) so that a spike's rows can be named

Per run, from step `--measure-from` on, with the bad batches' own losses left out (no remedy
can change a loss computed before its update): the independent episode count of spiky_lm.py
(`MedianEpisodes`: above 1.5x the median of the previous 50 losses until back within 10%) and
its share of steps in spike, OLMo 2's spike measures (`nanguard.record.spikes`: `ep`/`in sp`),
the final loss (mean of the last 50 training losses), the peak loss, the validation loss and
the wall time of the training loop (ratio to plain's of the same cause). From report.json:
the status, heal's LR / weight-decay cuts, the bad batches named (`spikes` entries with
`cause: bad_batch` against the loader's truth; their rows against the corrupted rows) and the
LR jump named (an `lr_jump` alarm at the jump's step with its factor). The last line printed
is one JSON object.

Usage:
    python benchmarks/spike_causes.py                    # the run recorded in BENCHMARKS.md
    python benchmarks/spike_causes.py --quick            # a smoke test: no measurement
    python benchmarks/spike_causes.py --causes bad --configs plain,heal --seeds 0,1
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from _spike_plant import BadLoader, bad_steps, jump_factor, lr_at  # noqa: E402
from _spiky_model import GPT, Data  # noqa: E402
from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.record.spikes import SpikeMeter  # noqa: E402
from spiky_lm import MedianEpisodes, ZClip  # noqa: E402

CAUSES = ("bad", "jump", "jump_held", "resume", "lr_wd")
CONFIGS = ("plain", "clip", "zclip", "observe", "skip", "rollback", "heal")
LAST = 50  # the final loss: mean of the last LAST training losses


class Run:
    """One training run's objects (rebuilt from a checkpoint at a resume)."""

    def __init__(self, config: str, seed: int, args: argparse.Namespace, data: Data,
                 out: Path, lr: float) -> None:
        torch.manual_seed(seed)
        self.model = GPT(vocab=data.vocab, context=data.context)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99),
                                     weight_decay=args.wd)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.zclip = ZClip() if config == "zclip" else None
        self.guard = None
        self.out = out
        if config in ("observe", "skip", "rollback", "heal"):
            model = self.model

            def replay(b: Any) -> torch.Tensor:
                return nn.functional.cross_entropy(model(b[0]).flatten(0, 1), b[1].flatten())

            self.guard = nanguard.Guard(self.model, self.opt, policy=config, replay=replay,
                                        config=GuardConfig(record=RecordConfig(
                                            out=out, summary=False)))

    def checkpoint(self) -> bytes:
        buf = io.BytesIO()
        z = self.zclip
        torch.save({"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                    "zclip": None if z is None else [z.first, z.mean, z.var],
                    "guard": None if self.guard is None else self.guard.state_dict()}, buf)
        return buf.getvalue()

    def resume(self, blob: bytes) -> None:
        ckpt = torch.load(io.BytesIO(blob), weights_only=True)  # never an untrusted pickle
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        if self.zclip is not None:
            self.zclip.first, self.zclip.mean, self.zclip.var = ckpt["zclip"]
        if self.guard is not None:
            self.guard.load_state_dict(ckpt["guard"])

    def close(self) -> dict[str, Any] | None:
        if self.guard is None:
            return None
        self.guard.close()
        return json.loads((self.out / "report.json").read_text())


def train(cause: str, config: str, seed: int, args: argparse.Namespace,
          data: Data) -> dict[str, Any]:
    """One run; returns its measures (see the module docstring)."""
    bad = bad_steps(args) if cause == "bad" else frozenset()
    steps = args.wd_steps if cause == "lr_wd" else args.steps
    loader = BadLoader(data, args.batch, bad, args.rows[0], args.rows[1], seed)
    meter, median = SpikeMeter(), MedianEpisodes()
    losses: list[float] = []  # measured (bad batches' own left out)
    reports: list[dict[str, Any]] = []
    wall = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(config, seed, args, data, Path(tmp) / "first", lr_at(cause, 0, args))
        for step in range(steps):
            if cause == "resume" and step == args.jump_at:
                blob = run.checkpoint()
                reports.append(run.close() or {})
                run = Run(config, seed, args, data, Path(tmp) / "resumed", args.lr)
                run.resume(blob)
            for g in run.opt.param_groups:
                g["lr"] = lr_at(cause, step, args)
            start = time.perf_counter()
            x, y = loader(step)
            loss = nn.functional.cross_entropy(run.model(x).flatten(0, 1), y.flatten())
            if run.guard is not None:
                run.guard.watch(loss=loss, batch=(x, y))
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = float(torch.linalg.vector_norm(torch.stack(
                torch._foreach_norm([p.grad for p in run.params if p.grad is not None]))))
            value = float(loss.detach())
            if config == "clip":
                torch.nn.utils.clip_grad_norm_(run.params, 1.0)
            elif run.zclip is not None:
                run.zclip(run.params, norm)
            run.opt.step()
            wall += time.perf_counter() - start
            if step >= args.measure_from and step not in bad:
                meter.update(step, {"loss": value})
                median.update(value)
                losses.append(value)
        reports.append(run.close() or {})
    return measures(cause, config, args, data, run.model, loader, reports, meter, median,
                    losses, wall)


def measures(cause: str, config: str, args: argparse.Namespace, data: Data, model: nn.Module,
             loader: BadLoader, reports: list[dict[str, Any]], meter: SpikeMeter,
             median: MedianEpisodes, losses: list[float], wall: float) -> dict[str, Any]:
    m = meter.summary()
    r: dict[str, Any] = {
        "episodes": median.episodes, "in_spike": median.in_spike / max(1, median.steps),
        "episodes_olmo": m["episodes_total"], "in_spike_olmo": m["time_in_spike"],
        "final_loss": statistics.fmean(losses[-LAST:]),
        "peak_loss": max(losses, default=math.nan), "val_loss": data.val_loss(model),
        "wall_s": wall, "bad_truth": {str(k): v for k, v in sorted(loader.truth.items())}}
    rep = reports[-1]
    if not rep:
        return r
    alarms = [a for p in reports for a in p.get("alarms", [])]
    actions = [a for p in reports for a in p.get("actions", [])]
    heal = (rep.get("run", {}).get("recovery") or {}).get("heal") or {}
    named = {s["step"]: s.get("rows") or [] for p in reports for s in p.get("spikes", [])
             if s.get("cause") == "bad_batch"}
    jumps = [(a["step"], round(float(a["value"]), 3)) for a in alarms if a["kind"] == "lr_jump"]
    r.update({
        "status": rep.get("status"), "alarms": len(alarms),
        "actions": {k: sum(a["action"] == k for a in actions)
                    for k in sorted({a["action"] for a in actions})},
        "cuts": [f"{c['action']}@{c['step']}" for c in heal.get("cuts", [])],
        "heal_cause": heal.get("cause"),
        "bad_named": {str(k): v for k, v in sorted(named.items())},
        "bad_named_ok": (sorted(named) == sorted(loader.truth)) if cause == "bad" else None,
        # rows named that were corrupted / all corrupted rows / rows named that were not
        "rows_hit": sum(len(set(named.get(s, [])) & set(t)) for s, t in loader.truth.items()),
        "rows_true": sum(len(t) for t in loader.truth.values()),
        "rows_false": sum(len(set(rows) - set(loader.truth.get(s, [])))
                          for s, rows in named.items()),
        "jumps": jumps,
        "jump_named_ok": ((args.jump_at, float(jump_factor(cause, args))) in jumps
                          if cause in ("jump", "resume", "jump_held") else None)})
    return r


def _yes(v: Any) -> str:
    return "-" if v is None else ("yes" if v else "NO")


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """Mean over seeds per cause and configuration, one row each."""
    head = (f"{'cause':<10}{'config':<9}{'med ep':>7}{'in spike':>9}{'ep':>5}{'in sp':>7}"
            f"{'final':>8}{'peak':>7}{'val':>8}{'wall s':>7}{'x plain':>8}  {'cuts':<12}"
            f"{'named':<6}{'rows':<9}{'jump':<5}status")
    rows = [head, "-" * len(head)]
    for cause, by in results.items():
        base = statistics.fmean(r["wall_s"] for r in by["plain"]) if "plain" in by else None
        for name, runs in by.items():
            def mean(k: str, runs: list[dict[str, Any]] = runs) -> float:
                return statistics.fmean(float(r[k]) for r in runs)

            def every(k: str, runs: list[dict[str, Any]] = runs) -> bool | None:
                vals = [r.get(k) for r in runs]
                return None if any(v is None for v in vals) else all(vals)

            ratio = f"{mean('wall_s') / base:.2f}x" if base else "-"
            cuts = ",".join(sorted({c for r in runs for c in r.get("cuts", [])})) or "-"
            named = "-" if "rows_true" not in runs[0] or cause != "bad" else (
                f"{sum(r['rows_hit'] for r in runs)}/{sum(r['rows_true'] for r in runs)}"
                f"+{sum(r['rows_false'] for r in runs)}")
            status = "/".join(sorted({str(r.get("status", "-")) for r in runs}))
            rows.append(
                f"{cause:<10}{name:<9}{mean('episodes'):>7.2f}{100 * mean('in_spike'):>8.2f}%"
                f"{mean('episodes_olmo'):>5.1f}{100 * mean('in_spike_olmo'):>6.2f}%"
                f"{mean('final_loss'):>8.4f}{mean('peak_loss'):>7.3f}{mean('val_loss'):>8.4f}"
                f"{mean('wall_s'):>7.1f}{ratio:>8}  {cuts[:11]:<12}{_yes(every('bad_named_ok')):<6}"
                f"{named:<9}{_yes(every('jump_named_ok')):<5}{status}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--seeds", default="0")
    p.add_argument("--causes", default=",".join(CAUSES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--lr", type=float, default=0.01, help="base LR of bad / jump / resume")
    p.add_argument("--wd-lr", type=float, default=0.1, help="the LR of lr_wd")
    p.add_argument("--wd-steps", type=int, default=1200, help="the steps of lr_wd")
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--factor", type=float, default=10.0, help="the LR jump (jump, resume)")
    p.add_argument("--held-lr", type=float, default=0.001, help="the LR before jump_held's jump")
    p.add_argument("--held-factor", type=float, default=50.0,
                   help="jump_held's jump (to 0.05 by default: an LR a warmed-up run holds)")
    p.add_argument("--jump-at", type=int, default=300, help="the jump's / resume's step")
    p.add_argument("--bad", type=int, default=4, help="bad batches (cause bad)")
    p.add_argument("--rows", default="8,16", help="corrupted rows per bad batch: lo,hi")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--measure-from", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--live", action="store_true", help="print nanguard's live warnings")
    p.add_argument("--quick", action="store_true", help="80 steps: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.measure_from, args.jump_at, args.bad = 80, 5, 5, 40, 1
        args.wd_steps = args.steps
    if not args.live:  # the table says what they said; 28 runs' warnings would bury it
        logging.getLogger("nanguard").setLevel(logging.ERROR)
    lo, _, hi = args.rows.partition(",")
    args.rows = (int(lo), int(hi or lo))
    if not 0 < args.rows[0] <= args.rows[1] <= args.batch:
        p.error(f"--rows {lo},{hi}: want 0 < lo <= hi <= --batch ({args.batch})")
    if not args.measure_from + LAST < min(args.steps, args.wd_steps):
        p.error("--steps must exceed --measure-from by more than 50")
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    causes = [c for c in args.causes.split(",") if c]
    configs = [c for c in args.configs.split(",") if c]
    for given, known in ((causes, CAUSES), (configs, CONFIGS)):
        if set(given) - set(known):
            p.error(f"unknown {sorted(set(given) - set(known))}; choose from {', '.join(known)}")
    data = Data()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    for cause in causes:
        for name in configs:
            for seed in seeds:
                r = train(cause, name, seed, args, data)
                results.setdefault(cause, {}).setdefault(name, []).append(r)
                print(f"{cause} {name} seed {seed}: " + ", ".join(
                    f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in r.items() if k not in ("bad_truth", "bad_named")),
                    flush=True)
    print(table(results))
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, " \
              f"{args.threads} thread(s)"
    print(json.dumps({"machine": machine, "steps": args.steps, "seeds": seeds,
                      "total_s": round(time.perf_counter() - started, 1),
                      "args": {k: v for k, v in vars(args).items() if k != "quick"},
                      "results": results}))


if __name__ == "__main__":
    main()
