"""Spikes of four causes on a program the project has not seen: karpathy/nanoGPT, unmodified
(issue 40's done-when, held out).

nanoGPT's own `train.py` runs as a user would run it, on CPU, one thread, with its configurator's
flags, in a scratch folder that holds the data it reads (`data/<name>/train.bin`, `val.bin`,
`meta.pkl`, written here as its `data/shakespeare_char/prepare.py` would: uint16 ids). The
"text" is made here: a sparse random Markov chain over 65 symbols (each symbol has 3 likely
successors, p 0.6 / 0.3 / 0.1), 300k symbols; `--seeds` vary the chain (and the corrupted
regions), since nanoGPT seeds its RNG with 1337 whatever its flags. The causes are planted
through flags and input files only:

    bad       train.bin has `--regions` corrupted regions of `--region-len` symbols: one symbol
              repeated, random bytes, the text under the wrong code table (a permutation of the
              ids), in turn; LR `--bad-lr` (1e-3). nanoGPT draws each row of a batch at a
              random offset, so most batches hold no corrupted row, some one or two, a few
              many: a batch is "bad" when
              `--bad-rows` or more of its rows are mostly corrupted. Which ones is known here,
              independently of nanguard: the sampler is replayed (torch.manual_seed(1337), the
              model built as train.py builds it, the same sequence of torch.randint calls:
              one batch before the loop, eval batches at every `--eval-interval`, then one per
              iteration), checked against the printed loss of iteration 0.
    jump      the LR ramps up to `--lr` (3e-3) over `--jump-at` (400) iterations and jumps 10x
              without warm-up there: `--warmup_iters=J --lr_decay_iters=J-1 --min_lr=10*lr` (past
              lr_decay_iters nanoGPT's schedule returns min_lr).
    resume    `--jump-at` iterations at `--lr` (warm-up, then held: `--lr_decay_iters` below the
              warm-up, `--min_lr=lr`), the checkpoint saved there (`--eval_interval=J`), then
              `--init_from=resume --decay_lr=False --warmup_iters=0` at `--resume-factor`
              (20) x the LR: the LR jumps at the resume's first iteration (10x does not spike
              on this model). Both halves run under the same configuration, their nanguard
              run folders side by side (as `nanguard_runs/<time>` folders are).
    lr_wd     no fault: a high LR (`--wd-lr`, 0.1, warm-up 100, cosine) with weight decay 0.1
              (nanoGPT's default).

Configurations: `plain` (`--grad_clip=0.0`; nanoGPT's default is 1.0), `clip` (its own
`--grad_clip=1.0`), and `nanguard run --policy P` for observe, skip, heal (all with
`--grad_clip=0.0`) and `heal_clip` (heal with `--grad_clip=1.0`).

Per run, from the losses nanoGPT prints (`iter N: loss X`), from iteration `--measure-from`
on, bad batches' own losses left out: the independent episode count of spiky_lm.py
(`MedianEpisodes`: above 1.5x the median of the previous 50 losses until back within 10%),
its share of iterations in spike, the final loss (mean of the last 50), the peak loss and the
last validation loss printed. From nanguard's report.json: the status, heal's LR / weight-decay
cuts, the batches named bad (`spikes` with `cause: bad_batch`) against the truth, and the LR
jump (an `lr_jump` alarm) with its step and factor.

Usage:
    python benchmarks/heldout_spikes.py /path/to/nanoGPT
    python benchmarks/heldout_spikes.py /path/to/nanoGPT --causes bad --configs plain,heal
    python benchmarks/heldout_spikes.py /path/to/nanoGPT --keep /tmp/runs   # keep the folders
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]
from spiky_lm import MedianEpisodes  # noqa: E402

SRC = HERE.parent / "src"
CAUSES = ("bad", "jump", "resume", "lr_wd")
CONFIGS = ("plain", "clip", "observe", "skip", "heal", "heal_clip")
VOCAB, LENGTH, LAST = 65, 300_000, 50
ITER = re.compile(r"^iter (\d+): loss ([-+0-9.naif]+)", re.M)
VAL = re.compile(r"^step (\d+): train loss [0-9.]+, val loss ([0-9.naif]+)", re.M)


def make_data(folder: Path, seed: int, args: argparse.Namespace, bad: bool) -> list[tuple]:
    """train.bin / val.bin / meta.pkl; returns the corrupted regions [(start, end, kind)]."""
    rng = np.random.default_rng(1000 + seed)
    succ = rng.integers(0, VOCAB, size=(VOCAB, 3))
    pick = rng.choice(3, size=LENGTH, p=[0.6, 0.3, 0.1])
    seq = np.empty(LENGTH, dtype=np.int64)
    seq[0] = 0
    for i in range(1, LENGTH):
        seq[i] = succ[seq[i - 1], pick[i]]
    n_train = int(LENGTH * 0.9)
    train, val = seq[:n_train].copy(), seq[n_train:]
    regions: list[tuple] = []
    if bad:
        starts = rng.choice(np.arange(1, n_train // args.region_len - 1), args.regions,
                            replace=False) * args.region_len
        perm = rng.permutation(VOCAB)
        for k, s in enumerate(sorted(int(x) for x in starts)):
            e = s + args.region_len
            kind = ("repeat", "random", "codetable")[k % 3]
            if kind == "repeat":
                train[s:e] = int(rng.integers(VOCAB))
            elif kind == "random":
                train[s:e] = rng.integers(0, VOCAB, e - s)
            else:
                train[s:e] = perm[train[s:e]]
            regions.append((s, e, kind))
    folder.mkdir(parents=True, exist_ok=True)
    train.astype(np.uint16).tofile(folder / "train.bin")
    val.astype(np.uint16).tofile(folder / "val.bin")
    chars = [chr(33 + i) for i in range(VOCAB)]
    with open(folder / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB, "itos": dict(enumerate(chars)),
                     "stoi": {c: i for i, c in enumerate(chars)}}, f)
    return regions


def replay_batches(nanogpt: Path, folder: Path, args: argparse.Namespace, iters: int
                   ) -> tuple[list[np.ndarray], float]:
    """The row offsets of each iteration's batch, as train.py draws them; and the loss of
    iteration 0 on the model train.py builds (to check the replay against its print)."""
    import torch
    sys.path.insert(0, str(nanogpt))
    from model import GPT, GPTConfig  # the checkout's, imported, not copied
    n_train = len(np.memmap(folder / "train.bin", dtype=np.uint16, mode="r"))
    n_val = len(np.memmap(folder / "val.bin", dtype=np.uint16, mode="r"))
    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=args.block, vocab_size=VOCAB, n_layer=args.layers,
                          n_head=args.heads, n_embd=args.embd, dropout=0.0, bias=False))

    def draw(n: int) -> np.ndarray:
        return torch.randint(n - args.block, (args.batch,)).numpy()

    batches = [draw(n_train)]
    for it in range(iters):
        if it % args.eval_interval == 0:
            for _ in range(args.eval_iters):
                draw(n_train)
            for _ in range(args.eval_iters):
                draw(n_val)
        batches.append(draw(n_train))
    data = np.fromfile(folder / "train.bin", dtype=np.uint16).astype(np.int64)
    ix = batches[0]
    x = torch.stack([torch.from_numpy(data[i:i + args.block]) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + args.block]) for i in ix])
    with torch.no_grad():
        _, loss0 = model(x, y)
    return batches, float(loss0)


def corrupted_rows(offsets: np.ndarray, regions: list[tuple], block: int) -> list[int]:
    """Rows whose x and y (block + 1 symbols) are mostly inside a corrupted region."""
    rows = []
    for r, i in enumerate(int(o) for o in offsets):
        inside = sum(max(0, min(i + block + 1, e) - max(i, s)) for s, e, _ in regions)
        if inside * 2 > block + 1:
            rows.append(r)
    return rows


def flags(args: argparse.Namespace, dataset: str, out: Path, iters: int) -> list[str]:
    return [f"--dataset={dataset}", f"--out_dir={out}", "--device=cpu", "--compile=False",
            "--dtype=float32", "--gradient_accumulation_steps=1", "--log_interval=1",
            f"--eval_iters={args.eval_iters}", f"--eval_interval={args.eval_interval}",
            f"--block_size={args.block}", f"--batch_size={args.batch}",
            f"--n_layer={args.layers}", f"--n_head={args.heads}", f"--n_embd={args.embd}",
            "--dropout=0.0", "--bias=False", "--beta2=0.99", f"--max_iters={iters}",
            "--always_save_checkpoint=True"]


def run_one(nanogpt: Path, work: Path, config: str, extra: list[str], tag: str,
            args: argparse.Namespace) -> tuple[str, Path | None]:
    """One train.py process under `config`; returns its output and its nanguard run folder."""
    clip = "1.0" if config in ("clip", "heal_clip") else "0.0"
    script = [str(nanogpt / "train.py"), *extra, f"--grad_clip={clip}"]
    out = None
    if config in ("plain", "clip"):
        cmd = [sys.executable, *script]
    else:
        out = work / f"ng-{tag}"
        policy = "heal" if config == "heal_clip" else config
        cmd = [sys.executable, "-m", "nanguard", "run", "--out", str(out), "--overwrite",
               "--policy", policy, "--quiet", *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(["nice", "-n", "19", *cmd], cwd=work, env=env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"heldout_spikes.py: {config} {tag} exited {p.returncode}: "
                         f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return p.stdout + p.stderr, out


def _one(run: tuple[str, Path | None]) -> tuple[tuple[str, ...], tuple[Path | None, ...]]:
    return (run[0],), (run[1],)


def report(out: Path | None) -> dict[str, Any]:
    if out is None:
        return {}
    path = out / "report.json"
    return json.loads(path.read_text()) if path.exists() else {"status": "no report"}


def train(nanogpt: Path, cause: str, config: str, seed: int, args: argparse.Namespace
          ) -> dict[str, Any]:
    """One run (two processes for `resume`); its measures (the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        work = Path(tmp)
        # train.py reads configurator.py and data/<dataset>/ from its working folder: a link to
        # the checkout's configurator, so the checkout itself is never written to
        (work / "configurator.py").symlink_to(nanogpt / "configurator.py")
        dataset = f"heldout{seed}"
        folder = work / "data" / dataset
        regions = make_data(folder, seed, args, bad=cause == "bad")
        ckpt = work / "out"
        lr, n = (args.bad_lr if cause == "bad" else args.lr), args.iters
        base = [*flags(args, dataset, ckpt, n), f"--learning_rate={lr}",
                f"--min_lr={lr / 10}", f"--lr_decay_iters={n}", f"--warmup_iters={args.warmup}"]
        texts: tuple[str, ...]
        outs: tuple[Path | None, ...]
        started = time.perf_counter()
        if cause == "bad":
            texts, outs = _one(run_one(nanogpt, work, config, base, "run", args))
        elif cause == "lr_wd":
            wd = [*base, f"--learning_rate={args.wd_lr}", f"--min_lr={args.wd_lr / 10}",
                  "--weight_decay=0.1"]
            texts, outs = _one(run_one(nanogpt, work, config, wd, "run", args))
        elif cause == "jump":
            j = args.jump_at
            jump = [*base, f"--warmup_iters={j}", f"--lr_decay_iters={j - 1}",
                    f"--min_lr={lr * args.factor}"]
            texts, outs = _one(run_one(nanogpt, work, config, jump, "run", args))
        else:  # resume
            j = args.jump_at
            # warm-up, then the LR held (past lr_decay_iters the schedule returns min_lr);
            # the resume holds 10x that LR from its first iteration (no schedule, no warm-up)
            first = [*flags(args, dataset, ckpt, j), f"--learning_rate={lr}", f"--min_lr={lr}",
                     f"--lr_decay_iters={args.warmup - 1}", f"--warmup_iters={args.warmup}",
                     f"--eval_interval={j}"]
            second = [*base, "--init_from=resume", f"--learning_rate={lr * args.resume_factor}",
                      "--decay_lr=False", "--warmup_iters=0"]
            a = run_one(nanogpt, work, config, first, "first", args)
            b = run_one(nanogpt, work, config, second, "resumed", args)
            texts, outs = (a[0], b[0]), (a[1], b[1])
        wall = time.perf_counter() - started
        losses: dict[int, float] = {}
        for text in texts:  # the resumed process's iteration j replaces the first's
            losses.update({int(i): float(v) for i, v in ITER.findall(text)})
        vals = VAL.findall(texts[-1])
        truth: dict[int, list[int]] = {}
        counts: dict[int, int] = {}
        check = None
        if cause == "bad":
            batches, loss0 = replay_batches(nanogpt, folder, args, n + 1)
            check = abs(loss0 - losses[0]) < 1e-3
            for it in range(n + 1):
                rows = corrupted_rows(batches[it], regions, args.block)
                counts[it] = len(rows)
                if len(rows) >= args.bad_rows:
                    truth[it] = rows
        reports = [report(o) for o in outs]
        if args.keep:  # the run folders and the script's output, for a look afterwards
            keep = Path(args.keep) / f"{cause}-{config}-{seed}"
            shutil.rmtree(keep, ignore_errors=True)
            keep.mkdir(parents=True)
            for k, (text, o) in enumerate(zip(texts, outs, strict=True)):
                (keep / f"output{k}.txt").write_text(text)
                if o is not None and o.exists():
                    shutil.copytree(o, keep / o.name)
    return measures(cause, config, args, losses, vals, truth, reports, wall, check, counts)


def measures(cause: str, config: str, args: argparse.Namespace, losses: dict[int, float],
             vals: list[tuple[str, str]], truth: dict[int, list[int]],
             reports: list[dict[str, Any]], wall: float, check: bool | None,
             counts: dict[int, int]) -> dict[str, Any]:
    median = MedianEpisodes()
    # every iteration above 1.5x the median of the 50 before (bad batches included), with the
    # corrupted rows its batch held: what a bad batch looks like in the loss
    # (by position in the printed losses: a program that prints no loss for some steps has
    # them missing from its keys, never a wrong step)
    steps = sorted(losses)
    history = [losses[i] for i in steps]
    spikes = [(steps[k], round(history[k] / statistics.median(history[k - 50:k]), 2),
               counts.get(steps[k], 0))
              for k in range(50, len(history)) if steps[k] >= args.measure_from
              and history[k] > 1.5 * statistics.median(history[k - 50:k])]
    kept = []
    for it in sorted(losses):
        if it >= args.measure_from and it not in truth:
            median.update(losses[it])
            kept.append(losses[it])
    r: dict[str, Any] = {
        "episodes": median.episodes, "in_spike": median.in_spike / max(1, median.steps),
        "final_loss": statistics.fmean(kept[-LAST:]), "peak_loss": max(kept),
        "val_loss": float(vals[-1][1]) if vals else None, "wall_s": round(wall, 1),
        "bad_truth": {str(k): v for k, v in sorted(truth.items())}, "replay_ok": check,
        "iters": len(losses), "loss_spikes": spikes[:40],
        "rows_hist": {str(k): sum(v == k for v in counts.values())
                      for k in sorted(set(counts.values()))}}
    rep = [p for p in reports if p]
    if not rep:
        return r
    factor = args.resume_factor if cause == "resume" else args.factor
    alarms = [a for p in rep for a in p.get("alarms", [])]
    actions = [a for p in rep for a in p.get("actions", [])]
    cuts = [f"{c['action']}@{c['step']}" for p in rep for c in
            ((p.get("run", {}).get("recovery") or {}).get("heal") or {}).get("cuts", [])]
    named = {s["step"]: s.get("rows") or [] for p in rep for s in p.get("spikes", [])
             if s.get("cause") == "bad_batch"}
    jumps = [(a["step"], round(float(a["value"]), 2)) for a in alarms if a["kind"] == "lr_jump"]
    r.update({
        "status": [p.get("status") for p in rep], "alarms": len(alarms),
        "alarm_kinds": sorted({a["kind"] for a in alarms}),
        "actions": {k: sum(a["action"] == k for a in actions)
                    for k in sorted({a["action"] for a in actions})},
        "cuts": cuts,
        "bad_named": {str(k): v for k, v in sorted(named.items())},
        "bad_hit": len(set(named) & set(truth)), "bad_true": len(truth),
        "bad_false": len(set(named) - set(truth)),
        "rows_hit": sum(len(set(named.get(s, [])) & set(t)) for s, t in truth.items()),
        "rows_true": sum(len(t) for t in truth.values()),
        "jumps": jumps,
        "jump_named_ok": (any(s == args.jump_at and abs(v / factor - 1) < 0.05
                              for s, v in jumps) if cause in ("jump", "resume") else None),
        "findings": [f.get("kind") or f.get("title") for p in rep
                     for f in (p.get("findings") or []) if isinstance(f, dict)]})
    return r


def table(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """One row per cause, configuration and seed."""
    head = (f"{'cause':<7}{'config':<10}{'seed':>4}{'ep':>4}{'in spike':>9}{'final':>8}"
            f"{'peak':>7}{'val':>8}{'wall s':>7}  {'cuts':<16}{'bad named':<11}{'jump':<15}"
            "status")
    rows = [head, "-" * len(head)]
    for cause, by in results.items():
        for name, runs in by.items():
            for r in runs:
                bad = (f"{r['bad_hit']}/{r['bad_true']}+{r['bad_false']}"
                       if "bad_hit" in r and cause == "bad" else "-")
                jump = ",".join(f"{s}:{v}x" for s, v in r.get("jumps", [])) or "-"
                cuts = ",".join(r.get("cuts", [])) or "-"
                rows.append(
                    f"{cause:<7}{name:<10}{r['seed']:>4}{r['episodes']:>4}"
                    f"{100 * r['in_spike']:>8.2f}%{r['final_loss']:>8.4f}{r['peak_loss']:>7.3f}"
                    f"{r['val_loss'] or float('nan'):>8.4f}{r['wall_s']:>7.1f}  {cuts[:15]:<16}"
                    f"{bad:<11}{jump[:14]:<15}{'/'.join(map(str, r.get('status', ['-'])))}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("nanogpt", nargs="?", help="a checkout of karpathy/nanoGPT")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--causes", default=",".join(CAUSES))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--lr", type=float, default=3e-3, help="the LR before the jump / resume")
    p.add_argument("--bad-lr", type=float, default=1e-3,
                   help="the LR of bad (nanoGPT's shakespeare_char config)")
    p.add_argument("--wd-lr", type=float, default=0.1, help="the LR of lr_wd")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--factor", type=float, default=10.0, help="the LR jump (jump, resume)")
    p.add_argument("--resume-factor", type=float, default=20.0, help="the resume's LR jump")
    p.add_argument("--jump-at", type=int, default=400, help="the jump's / resume's iteration")
    p.add_argument("--regions", type=int, default=4, help="corrupted regions (cause bad)")
    p.add_argument("--region-len", type=int, default=1000)
    p.add_argument("--bad-rows", type=int, default=3, help="corrupted rows of a bad batch")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--embd", type=int, default=64)
    p.add_argument("--eval-interval", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=20)
    p.add_argument("--keep", help="copy each run's nanguard folder and output here")
    p.add_argument("--measure-from", type=int, default=200)
    args = p.parse_args(argv)
    if not args.nanogpt:
        raise SystemExit("heldout_spikes.py: give the path of a nanoGPT checkout "
                         "(git clone https://github.com/karpathy/nanoGPT)")
    nanogpt = Path(args.nanogpt).resolve()
    if not (nanogpt / "train.py").is_file() or not (nanogpt / "model.py").is_file():
        raise SystemExit(f"heldout_spikes.py: {nanogpt} has no train.py and model.py: "
                         "not a nanoGPT checkout")
    seeds = [int(s) for s in args.seeds.split(",")]
    causes = [c for c in args.causes.split(",") if c]
    configs = [c for c in args.configs.split(",") if c]
    for given, known in ((causes, CAUSES), (configs, CONFIGS)):
        if set(given) - set(known):
            raise SystemExit(f"heldout_spikes.py: unknown {sorted(set(given) - set(known))}; "
                             f"choose from {', '.join(known)}")
    head = subprocess.run(["git", "-C", str(nanogpt), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown (not a git checkout)"
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.perf_counter()
    for cause in causes:
        for name in configs:
            for seed in seeds:
                r = {"seed": seed, **train(nanogpt, cause, name, seed, args)}
                results.setdefault(cause, {}).setdefault(name, []).append(r)
                print(f"{cause} {name} seed {seed}: " + json.dumps(
                    {k: v for k, v in r.items() if k not in ("bad_truth",)}), flush=True)
    print(table(results))
    print(json.dumps({"nanogpt": head, "load": os.getloadavg(),
                      "total_s": round(time.perf_counter() - started, 1),
                      "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
