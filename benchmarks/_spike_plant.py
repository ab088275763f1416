"""The planted causes of benchmarks/spike_causes.py: a loader that sometimes fills rows of a
batch from a corrupted region of the data, and the LR schedules (kept apart so that file
holds the remedies and the measurement only)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from _spiky_model import Data

CORRUPTIONS = ("repeat", "random", "codetable")
"""How a bad batch's rows are corrupted, in turn: one symbol repeated over the whole row
(input and target), uniformly random bytes (tokens), or the row's text read under the wrong
code table (a fixed permutation of the vocabulary)."""


@dataclass
class BadLoader:
    """Fresh batches of `data` (its `batch`); at the steps of `bad`, `rows_lo`..`rows_hi` rows
    (at random positions) come from a corrupted region instead. `truth` records, per bad step,
    the rows corrupted: established here, without nanguard."""

    data: Data
    batch: int
    bad: frozenset[int]
    rows_lo: int
    rows_hi: int
    seed: int
    truth: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.g = torch.Generator().manual_seed(20_000 + self.seed)
        # The corruption's own generator: a bad batch leaves the clean stream as it was.
        self.bad_g = torch.Generator().manual_seed(30_000 + self.seed)
        self.table = torch.randperm(self.data.vocab, generator=self.bad_g)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.batch(self.batch, self.g)
        if step not in self.bad:
            return x, y
        g, vocab = self.bad_g, self.data.vocab
        k = int(torch.randint(self.rows_lo, self.rows_hi + 1, (), generator=g))
        rows = sorted(torch.randperm(self.batch, generator=g)[:k].tolist())
        kind = CORRUPTIONS[len(self.truth) % len(CORRUPTIONS)]
        x, y = x.clone(), y.clone()
        for r in rows:
            if kind == "repeat":
                sym = int(torch.randint(0, vocab, (), generator=g))
                x[r], y[r] = sym, sym
            elif kind == "random":
                seq = torch.randint(0, vocab, (x.shape[1] + 1,), generator=g)
                x[r], y[r] = seq[:-1], seq[1:]
            else:
                x[r], y[r] = self.table[x[r]], self.table[y[r]]
        self.truth[step] = rows
        return x, y


def bad_steps(args: argparse.Namespace) -> frozenset[int]:
    """`args.bad` bad batches spread evenly over the measured part of the run (a short run:
    from 3/4 of it on, where the loss has settled)."""
    lo, hi = args.measure_from + 50, args.steps - 60
    if lo >= hi:
        lo, hi = args.steps * 3 // 4 - 1, args.steps - 1
    n = args.bad
    return frozenset(lo + (hi - lo) * (i + 1) // (n + 1) for i in range(n))


def lr_at(cause: str, step: int, args: argparse.Namespace) -> float:
    """The LR of `step` under `cause`'s schedule: a linear warm-up over `args.warmup` steps to
    the base LR (`args.wd_lr` for the LR x weight-decay cause), constant after it; `jump`:
    `args.factor` x from `args.jump_at` on, at once; `resume`: the same from the resume on (the
    resumed run is launched at the higher LR with no warm-up); `jump_held`: from
    `args.held_lr` `args.held_factor` x at `args.jump_at`, to an LR a warmed-up run holds."""
    base = {"lr_wd": args.wd_lr, "jump_held": args.held_lr}.get(cause, args.lr)
    lr = base * min(1.0, (step + 1) / args.warmup)
    if cause in ("jump", "resume", "jump_held") and step >= args.jump_at:
        lr = base * jump_factor(cause, args)
    return lr


def jump_factor(cause: str, args: argparse.Namespace) -> float:
    """The LR jump's factor of `cause` (`jump`, `resume` or `jump_held`)."""
    return args.held_factor if cause == "jump_held" else args.factor
