"""A small character LM trained the way a resumed run often is: AdamW with a schedule read from
flags, checkpoints saved and resumed, and (the planted fault) an LR that jumps `--jump` x at
`--jump_at` without warm-up (`--warmup 0`), or with a linear warm-up of `--warmup` steps from
the old LR. Prints `step N loss L lr R` every step; with `--guard POLICY` it trains under a
`nanguard.Guard` (saved and resumed with the checkpoint), otherwise plain.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class CharLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 48, context: int = 8) -> None:
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(context * dim, 128), nn.GELU(),
                                  nn.LayerNorm(128), nn.Linear(128, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x).flatten(1))


def corpus(seed: int, n: int = 20000, vocab: int = 32, words: int = 40) -> torch.Tensor:
    """Text with structure: 'words' of 3-6 symbols, each mostly followed by the same next word
    (a random one in 1 of 10), separated by 0."""
    g = torch.Generator().manual_seed(seed)
    lexicon = [torch.randint(1, vocab, (int(k),), generator=g)
               for k in torch.randint(3, 7, (words,), generator=g)]
    out: list[torch.Tensor] = []
    total, w = 0, 0
    while total < n:
        out += [lexicon[w], torch.zeros(1, dtype=torch.long)]
        total += len(lexicon[w]) + 1
        w = ((w * 7 + 3) % words if float(torch.rand((), generator=g)) < 0.9
             else int(torch.randint(0, words, (), generator=g)))
    return torch.cat(out)[:n]


def lr_at(step: int, args: argparse.Namespace) -> float:
    """The schedule: `--lr` until `--jump_at`, then `--jump` x it, reached over `--warmup`
    steps (0: at once)."""
    if args.jump_at is None or step < args.jump_at:
        return args.lr
    high = args.lr * args.jump
    if args.warmup and step < args.jump_at + args.warmup:
        return args.lr + (high - args.lr) * (step - args.jump_at + 1) / args.warmup
    return high


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--jump", type=float, default=10.0)
    p.add_argument("--jump_at", type=int, default=None)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default=None, help="save a checkpoint here at the end")
    p.add_argument("--resume", default=None, help="resume from this checkpoint")
    p.add_argument("--guard", default=None, help="train under nanguard.Guard(policy=GUARD)")
    p.add_argument("--out", default=None, help="the guard's run folder")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ at this (0: off)")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    data = corpus(args.seed)
    vocab, ctx, batch = 32, 8, 64
    model = CharLM(vocab, context=ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    start, ckpt = 0, None
    if args.resume:
        ckpt = torch.load(args.resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start = int(ckpt["step"])
        torch.set_rng_state(ckpt["rng"])
    guard = None
    if args.guard:
        from nanguard import Guard, GuardConfig, RecordConfig

        guard = Guard(model, opt, config=GuardConfig(
            policy=args.guard, record=RecordConfig(out=args.out, summary=False)))
        if ckpt is not None and ckpt.get("guard") is not None:
            guard.load_state_dict(ckpt["guard"])
    losses = []
    for step in range(start, start + args.steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(data) - ctx - 1, (batch,))
        x = data[idx[:, None] + torch.arange(ctx)]
        y = data[idx + ctx]
        loss = nn.functional.cross_entropy(model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
        print(f"step {step} loss {losses[-1]:.4f} lr {lr:.4g}", flush=True)
    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "step": start + args.steps, "rng": torch.get_rng_state(),
                    "guard": guard.state_dict() if guard is not None else None}, args.save)
    if guard is not None:
        guard.close()
    return losses


if __name__ == "__main__":
    main()
