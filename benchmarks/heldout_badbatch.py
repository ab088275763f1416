"""Bad batches on a program the project has not seen: pytorch/examples' `word_language_model`,
unmodified (issue 40's done-when, "the bad batches are named", held out).

`main.py` runs as a user would run it, on CPU, one thread, under `nice -n 19`, with its own
flags, reading a corpus written here in wikitext-2's layout (`train.txt`, `valid.txt`,
`test.txt`: words separated by spaces, one sentence a line; `data.Corpus` appends `<eos>` to
each line). The "text" is made here: a sparse random Markov chain over `--vocab` words and
`<eos>` (each word has 3 likely successors, p 0.6 / 0.3 / 0.1); `--seeds` vary the chain, the
planted batches and `main.py`'s `--seed`. Nothing is downloaded.

The loader the issue describes ("sometimes fills 16-32 rows of a batch from a corrupted
region") is planted through the input file only. `main.py`'s `batchify` cuts the training
tokens into `--batch_size` contiguous columns (column j = tokens [j * n, (j + 1) * n)) and
`get_batch` walks them `--bptt` rows at a time, in order, the same walk every epoch: so the
same window of rows corrupted in k of the columns is exactly one training batch with k
corrupted rows (samples), at step `epoch * batches_per_epoch + b` of every epoch, known here
before any run. `--plants` such batches, k drawn in `--rows` (of `--batch_size`), the kinds
in turn: one word repeated, random words, the text under a permuted vocabulary.

Configurations: `plain` (`--clip 1e9`: `main.py` always clips), `clip` (`--clip 0.25`, its
default), and `nanguard run --policy P` for observe, skip and heal (`--clip 1e9`), `heal_clip`
(heal with `--clip 0.25`), `observe_clip` (observe with it); `healthy` and `healthy_observe`
run heal and observe on the clean corpus (no plant), `healthy_clip` heal on it with `--clip
0.25`.

Per run, from the losses `main.py` prints (`--log-interval 1`: every batch's own loss, two
decimals; batch 0 of an epoch is never printed and batch 1's print is batches 0 and 1 summed:
both left out), from step `--measure-from` on, the bad batches'
own losses left out: the measures of `heldout_spikes.py` (`measures`: independent episode
count, share of steps in spike, final loss = mean of the last 50, peak) and the last `valid
loss` printed. From report.json: the status, heal's LR / weight-decay cuts, the batches
named bad (`spikes` with `cause: bad_batch`) against the plant (named true / truth + named
false) and the rows named against the planted columns. (nanguard's rows are dim 0 of the
batch, which for this sequence-first program is time: see BENCHMARKS.md.)

Usage:
    python benchmarks/heldout_badbatch.py /path/to/pytorch-examples
    python benchmarks/heldout_badbatch.py /path/to/pytorch-examples --configs plain,heal --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "src")]
from heldout_spikes import measures, report  # noqa: E402

SRC = HERE.parent / "src"
CONFIGS = ("plain", "clip", "observe", "skip", "heal", "heal_clip", "observe_clip", "healthy",
           "healthy_observe", "healthy_clip")
KINDS = ("repeat", "random", "permuted")
BATCH = re.compile(r"^\| epoch +(\d+) \| +(\d+)/ *(\d+) batches \|.*\| loss +([0-9.naif]+) \|",
                   re.M)
VALID = re.compile(r"^\| end of epoch +(\d+) \|.*\| valid loss +([0-9.naif]+) \|", re.M)


def words(vocab: int, rng: np.random.Generator) -> list[str]:
    """`vocab` distinct made-up words (syllables), index 0 the line end."""
    syl = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    out: list[str] = ["<eos>"]
    seen = set(out)
    while len(out) < vocab + 1:
        w = "".join(rng.choice(syl, size=int(rng.integers(1, 4))))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def chain(n: int, succ: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """`n` token ids of the Markov chain `succ` (3 successors each, p 0.6 / 0.3 / 0.1)."""
    pick = rng.choice(3, size=n, p=[0.6, 0.3, 0.1])
    seq = np.empty(n, dtype=np.int64)
    seq[0] = 0
    for i in range(1, n):
        seq[i] = succ[seq[i - 1], pick[i]]
    seq[-1] = 0  # the file ends with a line end, as data.Corpus reads every line
    return seq


def write_text(path: Path, seq: np.ndarray, vocab: list[str]) -> None:
    """The ids as text: a line per sentence, so that `data.Corpus` reads back exactly `seq`
    (it appends `<eos>`, id 0 here, to every line)."""
    lines, cur = [], []
    for t in seq.tolist():
        if t == 0:
            lines.append(" ".join(cur))
            cur = []
        else:
            cur.append(vocab[t])
    path.write_text("\n".join(lines) + "\n")


def make_corpus(folder: Path, seed: int, args: argparse.Namespace, plant: bool
                ) -> tuple[dict[int, list[int]], int]:
    """train/valid/test.txt in `folder`; returns the planted batches ({batch index within an
    epoch: the corrupted columns}) and the batches per epoch (`main.py`'s walk)."""
    rng = np.random.default_rng(4000 + seed)
    vocab = words(args.vocab, rng)
    n_ids = len(vocab)
    succ = rng.integers(0, n_ids, size=(n_ids, 3))
    seq = chain(args.tokens + 2 * args.tokens // 10, succ, rng)
    n_train = args.tokens
    train, valid, test = seq[:n_train].copy(), seq[n_train:n_train + n_train // 10], \
        seq[n_train + n_train // 10:]
    train[-1] = valid[-1] = 0
    valid[0] = test[0] = 0
    bsz, bptt = args.batch_size, args.bptt
    rows = n_train // bsz  # batchify: each column holds `rows` consecutive tokens
    per_epoch = len(range(0, rows - 1, bptt))
    planted: dict[int, list[int]] = {}
    if plant:
        # spread over the epoch, never its first `--clean-first` batches (the level's warm-up)
        # nor its last two (the short final window)
        slots = rng.choice(np.arange(args.clean_first, per_epoch - 2), args.plants, replace=False)
        perm = rng.permutation(np.arange(1, n_ids))
        lo, hi = (int(x) for x in args.rows.split("-"))
        for m, b in enumerate(sorted(int(s) for s in slots)):
            k = int(rng.integers(lo, hi + 1))
            cols = sorted(int(c) for c in rng.choice(bsz, k, replace=False))
            kind = KINDS[m % len(KINDS)]
            for j in cols:
                # the batch's inputs (rows b*bptt ..) and targets (.. + bptt) of column j
                s = j * rows + b * bptt
                e = s + bptt + 1
                if kind == "repeat":
                    train[s:e] = int(rng.integers(1, n_ids))
                elif kind == "random":
                    train[s:e] = rng.integers(1, n_ids, e - s)
                else:  # another code table: every word id through a fixed permutation
                    body = train[s:e]
                    train[s:e] = np.where(body > 0, perm[np.maximum(body - 1, 0)], 0)
            planted[b] = cols
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "train.txt", train, vocab)
    write_text(folder / "valid.txt", valid, vocab)
    write_text(folder / "test.txt", test, vocab)
    return planted, per_epoch


def run_one(examples: Path, work: Path, config: str, seed: int, args: argparse.Namespace
            ) -> tuple[str, Path | None]:
    """One `main.py` process under `config`; its output and its nanguard run folder."""
    clip = args.clip if config.endswith("clip") else "1e9"
    script = [str(examples / "word_language_model" / "main.py"), "--data", str(work / "data"),
              "--model", args.model, "--emsize", str(args.emsize), "--nhid", str(args.nhid),
              "--nlayers", str(args.nlayers), "--batch_size", str(args.batch_size),
              "--bptt", str(args.bptt), "--epochs", str(args.epochs), "--lr", str(args.lr),
              "--use-optimizer", "--log-interval", "1", "--seed", str(seed), "--clip", clip,
              "--save", str(work / "model.pt")]
    out = None
    if config in ("plain", "clip"):
        cmd = [sys.executable, *script]
    else:
        out = work / "ng"
        policy = {"heal_clip": "heal", "observe_clip": "observe", "healthy": "heal",
                  "healthy_observe": "observe", "healthy_clip": "heal"}.get(config, config)
        cmd = [sys.executable, "-m", "nanguard", "run", "--out", str(out), "--overwrite",
               "--policy", policy, "--quiet", *script]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")])))
    p = subprocess.run(["nice", "-n", "19", *cmd], cwd=work, env=env, capture_output=True,
                       text=True)
    if p.returncode != 0:
        raise SystemExit(f"heldout_badbatch.py: {config} seed {seed} exited {p.returncode}: "
                         f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return p.stdout + p.stderr, out


def train(examples: Path, config: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run; its measures (the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="heldout-wlm-") as tmp:
        work = Path(tmp)
        planted, per_epoch = make_corpus(work / "data", seed, args,
                                         plant=not config.startswith("healthy"))
        started = time.perf_counter()
        text, out = run_one(examples, work, config, seed, args)
        wall = time.perf_counter() - started
        reports = [report(out)] if out is not None else []
        if args.keep:
            keep = Path(args.keep) / f"{config}-{seed}"
            keep.mkdir(parents=True, exist_ok=True)
            (keep / "output.txt").write_text(text)
            if reports:
                (keep / "report.json").write_text(json.dumps(reports[0], indent=1))
    # the global step of epoch e's batch b is (e - 1) * per_epoch + b: the optimizer steps once
    # a batch, and main.py prints every batch's loss but the first of each epoch
    # (batch 1's print is batches 0 and 1's losses summed: main.py resets its running total
    # only when it prints, and batch 0 is never printed; left out)
    losses = {(int(e) - 1) * per_epoch + int(b): float(v) for e, b, _, v in BATCH.findall(text)
              if int(b) > 1}
    vals = [(e, v) for e, v in VALID.findall(text)]
    truth = {e * per_epoch + b: cols for e in range(args.epochs) for b, cols in planted.items()}
    counts = {s: len(c) for s, c in truth.items()}
    m = measures("bad", config, args, losses, vals, truth, reports, wall, None, counts)
    m["per_epoch"] = per_epoch
    m["bad_losses"] = {str(s): losses.get(s) for s in sorted(truth)}
    return m


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """One row per configuration and seed."""
    head = (f"{'config':<10}{'seed':>4}{'ep':>4}{'in spike':>9}{'final':>8}{'peak':>7}"
            f"{'val':>7}{'wall s':>7}  {'cuts':<14}{'bad named':<11}{'rows':<9}{'actions':<22}"
            "status")
    rows = [head, "-" * len(head)]
    for name, runs in results.items():
        for r in runs:
            bad = f"{r['bad_hit']}/{r['bad_true']}+{r['bad_false']}" if "bad_hit" in r else "-"
            named_rows = f"{r['rows_hit']}/{r['rows_true']}" if "rows_hit" in r else "-"
            acts = ",".join(f"{k}:{v}" for k, v in r.get("actions", {}).items()) or "-"
            rows.append(
                f"{name:<10}{r['seed']:>4}{r['episodes']:>4}{100 * r['in_spike']:>8.2f}%"
                f"{r['final_loss']:>8.4f}{r['peak_loss']:>7.2f}"
                f"{r['val_loss'] or float('nan'):>7.2f}"
                f"{r['wall_s']:>7.1f}  {','.join(r.get('cuts', [])) or '-':<14}{bad:<11}"
                f"{named_rows:<9}{acts[:21]:<22}{'/'.join(map(str, r.get('status', ['-'])))}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("examples", nargs="?", help="a checkout of pytorch/examples")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--vocab", type=int, default=300, help="words of the made-up language")
    p.add_argument("--tokens", type=int, default=150_000, help="training tokens")
    p.add_argument("--plants", type=int, default=4, help="bad batches per epoch")
    p.add_argument("--rows", default="12-20", help="corrupted rows of a bad batch (range)")
    p.add_argument("--clean-first", type=int, default=40,
                   help="no plant among an epoch's first N batches")
    p.add_argument("--model", default="LSTM")
    p.add_argument("--emsize", type=int, default=64)
    p.add_argument("--nhid", type=int, default=64)
    p.add_argument("--nlayers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=20)
    p.add_argument("--bptt", type=int, default=35)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", default="0.25", help="the clip of `clip` (main.py's default)")
    p.add_argument("--measure-from", type=int, default=100)
    p.add_argument("--keep", help="copy each run's output and report.json here")
    args = p.parse_args(argv)
    # heldout_spikes.measures reads these (its jump checks; no jump here)
    args.factor = args.resume_factor = 1.0
    args.jump_at = -1
    if not args.examples:
        raise SystemExit("heldout_badbatch.py: give the path of a pytorch/examples checkout "
                         "(git clone https://github.com/pytorch/examples)")
    examples = Path(args.examples).resolve()
    if not (examples / "word_language_model" / "main.py").is_file():
        raise SystemExit(f"heldout_badbatch.py: {examples} has no word_language_model/main.py: "
                         "not a pytorch/examples checkout")
    configs = [c for c in args.configs.split(",") if c]
    if set(configs) - set(CONFIGS):
        raise SystemExit(f"heldout_badbatch.py: unknown {sorted(set(configs) - set(CONFIGS))}; "
                         f"choose from {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    head = subprocess.run(["git", "-C", str(examples), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown (not a git checkout)"
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for name in configs:
        for seed in seeds:
            r = {"seed": seed, **train(examples, name, seed, args)}
            results.setdefault(name, []).append(r)
            print(f"{name} seed {seed}: " + json.dumps(r), flush=True)
    print(table(results))
    print(json.dumps({"examples": head, "load": os.getloadavg(),
                      "total_s": round(time.perf_counter() - started, 1),
                      "args": vars(args), "results": results}))


if __name__ == "__main__":
    main()
