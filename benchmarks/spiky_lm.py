"""Loss spikes on a small GPT LM, and what each remedy does about them (issue 30, DESIGN.md
section 5 "spikes").

The LM (2 layers, d_model 32, 2 heads, context 16, vocab 64, ~30k parameters) learns a sparse
random Markov chain (2 likely successors per token, 5% noise) from fresh batches of 32
sequences, AdamW (betas 0.9 / `--b2` 0.99, weight decay `--wd` 0.1), linear warm-up over 50
steps then constant LR, 3000 steps. At the spiky LR (0.1) the loss falls to its floor (~1.1)
within 100 steps, then jumps (to 2-4) again and again, 3-5 times per run in most seeds: the grad
norm jumps 3-30x its rolling mean one step before, while Adam's second moments (averaged over
~100 steps by beta2 0.99) still hold the small gradients of before, so that update is many
times its usual size. At the stable LR (0.003) nothing happens. (The earlier setting, lr 0.06,
beta2 0.999, no weight decay, 2000 steps, spiked once per seed: beta2 0.999 keeps the second
moments of a spike for ~1000 steps, which holds the next one off.) Configurations, each on
the same seeds, data and initial weights:

    stable            plain AdamW at the stable LR
    plain             plain AdamW at the spiky LR
    clip              clip_grad_norm_(1.0)
    zclip             ZClip (Kumar et al. 2025): EMA mean and variance of the grad norm
                      (alpha 0.97, initialised over 25 steps), z-score threshold 2.5, a spike
                      clipped to mean + (2.5^2 / z) * std ("reciprocal"), the EMA fed the
                      clipped norm
    skip_sigma        OLMo-style skip: no update when the loss or the grad norm is more than
                      6 standard deviations above the mean of the previous 128 steps (20
                      needed first)
    nanguard_observe  Guard(policy="observe"): nothing changes, the cost of watching
    nanguard_skip     Guard(policy="skip")
    nanguard_rollback Guard(policy="rollback")
    nanguard_heal     Guard(policy="heal"): clip the grad-norm jump before its update, cut the
                      weight decay or the LR when jumps recur (HealConfig.correct="auto")
    nanguard_heal_lr, nanguard_heal_wd, nanguard_heal_clip
                      the same, always cutting the LR / always the weight decay / never
                      cutting (clip only): what the choice of `auto` rests on
    stable_observe    Guard(policy="observe") at the stable LR: must end with the same weights,
                      bit for bit, as `stable` (the `weights` hash)
    stable_heal       Guard(policy="heal") at the stable LR: must take no action

Per run: the spike measures of the training loss the loop computed (`nanguard.record.spikes`:
OLMo 2's spike score, episodes, time in spike; the grad norm's score too) from step
`--measure-from` (200) on: the first window would otherwise hold the initial descent from
ln(64) = 4.2, whose spread hides a jump to 3.6 from 1.2 (7 sigma of that window is ~3). Also the
final validation loss (256 held-out sequences of the same chain), the wall time of the
training loop and the actions (updates skipped by skip_sigma; nanguard's actions). Every
configuration computes the global grad norm each step (for the measures), so that cost is
in all of them. Also an independent episode count that shares no code with nanguard
(`MedianEpisodes`: an episode starts at a loss above 1.5x the median of the previous 50 and
ends at the first loss back within 10% of it; `med ep`, `med in` in the table), the alarms
nanguard raised and a hash of the final weights. The table gives the mean over seeds; the last
line printed is one JSON object.

Usage:
    python benchmarks/spiky_lm.py                      # the run recorded in BENCHMARKS.md
    python benchmarks/spiky_lm.py --quick              # a few steps, one seed: a smoke test
    python benchmarks/spiky_lm.py --configs plain,zclip --seeds 0,1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from _spiky_model import GPT, Data  # noqa: E402
from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.config import HealConfig  # noqa: E402
from nanguard.record.spikes import SpikeMeter  # noqa: E402

CONFIGS = ("stable", "plain", "clip", "zclip", "skip_sigma", "nanguard_observe",
           "nanguard_skip", "nanguard_rollback", "nanguard_heal", "nanguard_heal_lr",
           "nanguard_heal_wd", "nanguard_heal_clip", "stable_observe", "stable_heal")
HEAL_CORRECT = {"nanguard_heal": "auto", "nanguard_heal_lr": "lr", "nanguard_heal_wd": "wd",
                "nanguard_heal_clip": "none", "stable_heal": "auto"}


class MedianEpisodes:
    """The independent count (not nanguard's code): an episode starts at a loss above `k` x
    the median of the previous `window` losses (while none is open) and ends at the first
    loss back within `tol` of that median, frozen at the jump."""

    def __init__(self, k: float = 1.5, window: int = 50, tol: float = 0.1) -> None:
        self.k, self.tol = k, tol
        self.hist: deque[float] = deque(maxlen=window)
        self.level: float | None = None
        self.episodes = 0
        self.in_spike = 0
        self.steps = 0

    def update(self, loss: float) -> None:
        self.steps += 1
        if self.level is not None:
            if math.isfinite(loss) and loss <= self.level * (1 + self.tol):
                self.level = None
            else:
                self.in_spike += 1
        elif len(self.hist) == self.hist.maxlen:
            med = statistics.median(self.hist)
            if not math.isfinite(loss) or loss > self.k * med:
                self.level, self.episodes = med, self.episodes + 1
                self.in_spike += 1
        if math.isfinite(loss):
            self.hist.append(loss)


class ZClip:
    """ZClip's adaptive clipping (Kumar et al. 2025, "ZClip: Adaptive Spike Mitigation for
    LLM Pre-Training"), called after backward, before the optimizer step."""

    def __init__(self, alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25) -> None:
        self.alpha, self.z_thresh, self.warmup = alpha, z_thresh, warmup
        self.first: list[float] = []
        self.mean: float | None = None
        self.var = 0.0

    def __call__(self, params: list[nn.Parameter], norm: float) -> None:
        if self.mean is None:
            self.first.append(norm)
            if len(self.first) == self.warmup:
                self.mean = statistics.fmean(self.first)
                self.var = statistics.pvariance(self.first)
            return
        std = math.sqrt(self.var)
        z = (norm - self.mean) / std if std > 0 else 0.0
        if z > self.z_thresh:
            clipped = self.mean + (self.z_thresh ** 2 / z) * std
            torch.nn.utils.clip_grad_norm_(params, clipped)
            norm = clipped
        # The EMA sees the clipped norm: a spike does not inflate the statistics.
        self.mean = self.alpha * self.mean + (1 - self.alpha) * norm
        self.var = self.alpha * self.var + (1 - self.alpha) * (norm - self.mean) ** 2


class SigmaSkip:
    """OLMo-style skip step: True (skip the update) when the loss or the grad norm lies more
    than `sigmas` standard deviations above the mean of the previous `window` steps."""

    def __init__(self, window: int = 128, sigmas: float = 6.0, min_steps: int = 20) -> None:
        self.sigmas, self.min_steps = sigmas, min_steps
        self.hist: dict[str, deque[float]] = {"loss": deque(maxlen=window),
                                              "grad": deque(maxlen=window)}

    def __call__(self, loss: float, grad: float) -> bool:
        skip = not (math.isfinite(loss) and math.isfinite(grad))
        for key, x in (("loss", loss), ("grad", grad)):
            h = self.hist[key]
            if len(h) >= self.min_steps and math.isfinite(x):
                mean, std = statistics.fmean(h), statistics.pstdev(h)
                skip = skip or x > mean + self.sigmas * std
            if math.isfinite(x):
                h.append(x)
        return skip


def train(config: str, seed: int, args: argparse.Namespace, data: Data) -> dict[str, Any]:
    """One run; returns its spike measures, final validation loss and wall time."""
    torch.manual_seed(seed)
    model = GPT(vocab=data.vocab, context=data.context)
    lr = args.stable_lr if config.startswith("stable") else args.lr
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, args.b2),
                            weight_decay=args.wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(20_000 + seed)
    zclip = ZClip() if config == "zclip" else None
    sigma = SigmaSkip() if config == "skip_sigma" else None
    guard = None
    with tempfile.TemporaryDirectory() as tmp:
        if config.startswith("nanguard_") or config in ("stable_observe", "stable_heal"):
            policy = "heal" if config in HEAL_CORRECT else config.split("_")[1]
            guard = nanguard.Guard(model, opt, policy=policy, config=GuardConfig(
                record=RecordConfig(out=tmp, summary=False),
                heal=HealConfig(correct=HEAL_CORRECT.get(config, "auto"))))
        meter = SpikeMeter()
        median = MedianEpisodes()
        skipped = 0
        start = time.perf_counter()
        for step in range(args.steps):
            x, y = data.batch(args.batch, g)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            if guard is not None:
                guard.watch(loss=loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = float(torch.linalg.vector_norm(torch.stack(
                torch._foreach_norm([p.grad for p in params if p.grad is not None]))))
            value = float(loss.detach())
            if config == "clip":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            elif zclip is not None:
                zclip(params, norm)
            if sigma is not None and sigma(value, norm):
                skipped += 1
            else:
                opt.step()
            sched.step()
            if step >= args.measure_from:
                meter.update(step, {"loss": value, "grad_norm": norm})
                median.update(value)
        wall = time.perf_counter() - start
        actions, cause, alarms = skipped, None, 0
        if guard is not None:
            report = guard.close()
            actions, alarms = len(report.actions), len(report.alarms)
            cause = (report.run.get("recovery") or {}).get("heal", {}).get("cause")
    m = meter.summary()
    return {"episodes": m["episodes_total"], "time_in_spike": m["time_in_spike"],
            "episodes_median": median.episodes,
            "in_spike_median": median.in_spike / max(1, median.steps),
            "score_loss": m["score"]["loss"], "score_grad": m["score"]["grad_norm"],
            "val_loss": data.val_loss(model), "wall_s": wall, "actions": actions,
            "alarms": alarms, "cause": cause,
            # the final weights' hash: `stable_observe` must equal `stable` bit for bit
            "weights": hashlib.sha256(b"".join(
                p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]}


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Mean over seeds per configuration, one row each."""
    base = statistics.fmean(r["wall_s"] for r in results.get("plain", [])) if (
        "plain" in results) else None
    head = (f"{'config':<18}{'episodes':>9}{'in spike':>10}{'med ep':>7}{'med in':>8}"
            f"{'score loss':>11}{'score grad':>11}"
            f"{'val loss':>10}{'wall s':>8}{'vs plain':>9}{'actions':>8}{'alarms':>7}")
    rows = [head, "-" * len(head)]
    for name, runs in results.items():
        def mean(k: str, runs: list[dict[str, Any]] = runs) -> float:
            return statistics.fmean(float("nan") if r[k] is None else r[k] for r in runs)

        ratio = f"{mean('wall_s') / base:.2f}x" if base else "-"
        rows.append(f"{name:<18}{mean('episodes'):>9.2f}{100 * mean('time_in_spike'):>9.2f}%"
                    f"{mean('episodes_median'):>7.2f}{100 * mean('in_spike_median'):>7.2f}%"
                    f"{100 * mean('score_loss'):>10.2f}%{100 * mean('score_grad'):>10.2f}%"
                    f"{mean('val_loss'):>10.4f}{mean('wall_s'):>8.1f}{ratio:>9}"
                    f"{mean('actions'):>8.1f}{mean('alarms'):>7.1f}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr", type=float, default=0.1, help="the spiky LR")
    p.add_argument("--stable-lr", type=float, default=0.003)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--measure-from", type=int, default=200,
                   help="feed the spike measures from this step on (past the first descent)")
    p.add_argument("--b2", type=float, default=0.99)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="40 steps, seed 0: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.warmup, args.measure_from = 40, "0", 5, 0
    torch.set_num_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = [c for c in args.configs.split(",") if c]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}; choose from {', '.join(CONFIGS)}")
    data = Data()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in configs:
        for seed in seeds:
            r = train(name, seed, args, data)
            results.setdefault(name, []).append(r)
            print(f"{name} seed {seed}: " + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()),
                flush=True)
    print(table(results))
    machine = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, " \
              f"{args.threads} thread(s)"
    print(json.dumps({"machine": machine, "steps": args.steps, "seeds": seeds, "lr": args.lr,
                      "stable_lr": args.stable_lr, "results": results}))


if __name__ == "__main__":
    main()
