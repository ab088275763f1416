"""Train a tiny character-level language model (an embedding, a GRU, a linear head; Adam) on
a synthetic corpus, reading fixed-length windows through a DataLoader.

    python bad_rows_lm.py --iters 160
    python bad_rows_lm.py --iters 160 --corrupt-at 70,110,140 --bad-rows 8 [--log-every 1]

How it fails:
  * `--corrupt-at STEPS`: at those steps the loader fills `--bad-rows` rows of the batch from a
    corrupted region of the data (random bytes, as a file read under the wrong code table or
    a damaged shard would give). The batch's own loss jumps; the model and the optimizer are
    as healthy as on the step before. The script prints `BAD_BATCH step S rows R` on stderr
    for each, the truth a test checks against.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

TEXT = ("the cat sat on the mat and the dog ran to the park while the bird sang "
        "a song of the sea and the sky over the hill where the old tree stands ")
WORDS = TEXT.split()


def corpus(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
    return " ".join(WORDS[i] for i in idx).encode()


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random windows of the corpus (a fresh window per index, as nanoGPT's get_batch)."""

    def __init__(self, data: bytes, block: int, length: int, seed: int) -> None:
        self.data = torch.tensor(list(data), dtype=torch.long)
        self.block, self.length = block, length
        self.g = torch.Generator().manual_seed(seed)
        self.corrupt: set[int] = set()  # sample indices to read from the corrupted region

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.corrupt:
            chunk = torch.randint(128, 256, (self.block + 1,), generator=self.g)
        else:
            s = int(torch.randint(0, len(self.data) - self.block - 1, (1,), generator=self.g))
            chunk = self.data[s:s + self.block + 1]
        return chunk[:-1], chunk[1:]


class CharLM(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        out: torch.Tensor = self.head(h)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=160)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--block", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corrupt-at", default="", help="comma-separated steps with bad rows")
    ap.add_argument("--bad-rows", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=40, help="print the loss every N steps")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    corrupt_at = {int(s) for s in args.corrupt_at.split(",") if s}
    ds = Windows(corpus(4000, args.seed), args.block, args.iters * args.batch_size, args.seed)
    # Which rows of which step are bad is decided up front: the loader reads them in order.
    g = torch.Generator().manual_seed(args.seed + 1)
    for step in sorted(corrupt_at):
        rows = sorted(torch.randperm(args.batch_size, generator=g)[:args.bad_rows].tolist())
        ds.corrupt |= {step * args.batch_size + r for r in rows}
        print(f"BAD_BATCH step {step} rows {','.join(map(str, rows))}", file=sys.stderr)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=False)
    model = CharLM()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    losses = []
    for step, (x, y) in enumerate(loader):
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f}")
    tail = losses[-20:]
    print(f"final loss {sum(tail) / len(tail):.4f}")


if __name__ == "__main__":
    main()
