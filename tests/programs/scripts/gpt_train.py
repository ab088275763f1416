"""Train a tiny byte-level GPT, nanoGPT style (token + position embeddings, pre-LayerNorm
blocks with causal self-attention and an MLP, AdamW with decoupled weight decay on the matrices,
linear warm-up then cosine decay, gradient clipping, periodic eval + checkpoint, resume).

    python gpt_train.py --max-iters 40
    python gpt_train.py --out-dir ckpt --always-save-checkpoint --max-iters 6 --eval-interval 6
    python gpt_train.py --init-from resume --out-dir ckpt --max-iters 12

How it fails:
  * `--lr 1e3` (a typo for 1e-3): AdamW's decoupled decay multiplies every matrix by
    (1 - lr * weight_decay) = -99 per step and the updates are +-lr; the weights grow
    geometrically until float32 overflows: optimizer divergence.
  * `--init-from resume` on a checkpoint whose optimizer state (e.g. an `exp_avg_sq`) or a
    weight holds NaN: the first update after loading writes NaN into the weights.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn
from torch.nn import functional as F

DEFAULT_TEXT = (
    "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
    "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. "
    "First Citizen: First, you know Caius Marcius is chief enemy to the people. "
    "All: We know't, we know't. First Citizen: Let us kill him, and we'll have corn at our own "
    "price. Is't a verdict? All: No more talking on't; let it be done: away, away! "
)


# --------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        assert n_embd % n_head == 0
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.n_embd = n_embd
        mask = torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size)
        self.register_buffer("bias", mask)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        # manual implementation of attention
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, dropout: float) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(n_embd, n_head, block_size, dropout)
                             for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float]) -> torch.optim.AdamW:
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for p in param_dict.values() if p.dim() >= 2]
        nodecay_params = [p for p in param_dict.values() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas)


# --------------------------------------------------------------------------- training


def main() -> None:
    p = argparse.ArgumentParser(description="train a tiny byte-level GPT")
    p.add_argument("--out-dir", default="out")
    p.add_argument("--dataset", default=None, help="text file (default: a built-in snippet)")
    p.add_argument("--init-from", default="scratch", choices=["scratch", "resume"])
    p.add_argument("--eval-interval", type=int, default=20)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--always-save-checkpoint", action="store_true")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", "--learning-rate", dest="learning_rate", type=float, default=1e-3)
    p.add_argument("--max-iters", type=int, default=40)
    p.add_argument("--weight-decay", type=float, default=1e-1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--decay-lr", type=int, default=1)
    p.add_argument("--warmup-iters", type=int, default=10)
    p.add_argument("--lr-decay-iters", type=int, default=40)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1337)
    args = p.parse_args()

    os.makedirs(args.out_dir, exist_ok=True)
    torch.manual_seed(args.seed)
    device = "cpu"

    text = DEFAULT_TEXT * 8
    if args.dataset:
        with open(args.dataset, encoding="utf-8") as f:
            text = f.read()
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    n = int(0.9 * len(data))
    splits = {"train": data[:n], "val": data[n:]}
    vocab_size = 256

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        d = splits[split]
        ix = torch.randint(len(d) - args.block_size, (args.batch_size,))
        x = torch.stack([d[i:i + args.block_size] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + args.block_size] for i in ix])
        return x.to(device), y.to(device)

    model_args = dict(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                      n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    iter_num = 0
    best_val_loss = 1e9
    checkpoint = None
    if args.init_from == "scratch":
        print("Initializing a new model from scratch")
        model = GPT(**model_args)
    else:
        print(f"Resuming training from {args.out_dir}")
        ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
        checkpoint = torch.load(ckpt_path, map_location=device)
        model_args = checkpoint["model_args"]
        model = GPT(**model_args)
        state_dict = checkpoint["model"]
        unwanted_prefix = "_orig_mod."
        for k in list(state_dict.keys()):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix):]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        iter_num = checkpoint["iter_num"]
        best_val_loss = checkpoint["best_val_loss"]
    model.to(device)

    optimizer = model.configure_optimizers(args.weight_decay, args.learning_rate,
                                           (args.beta1, args.beta2))
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None  # free up memory

    tracer = None
    if os.environ.get("NANTRACE"):
        from _nantrace import Tracer
        tracer = Tracer([model], [optimizer])

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                _, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    def get_lr(it: int) -> float:
        # 1) linear warmup for warmup_iters steps
        if it < args.warmup_iters:
            return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
        # 2) if it > lr_decay_iters, return min learning rate
        if it > args.lr_decay_iters:
            return args.min_lr
        # 3) in between, use cosine decay down to min learning rate
        decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return args.min_lr + coeff * (args.learning_rate - args.min_lr)

    X, Y = get_batch("train")
    t0 = time.time()
    while True:
        lr = get_lr(iter_num) if args.decay_lr else args.learning_rate
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        if iter_num % args.eval_interval == 0:
            losses = estimate_loss()
            print(f"step {iter_num}: train loss {losses['train']:.4f}, "
                  f"val loss {losses['val']:.4f}")
            if losses["val"] < best_val_loss or args.always_save_checkpoint:
                best_val_loss = min(best_val_loss, losses["val"])
                if iter_num > 0:
                    ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "model_args": model_args, "iter_num": iter_num,
                            "best_val_loss": best_val_loss, "config": vars(args)}
                    print(f"saving checkpoint to {args.out_dir}")
                    torch.save(ckpt, os.path.join(args.out_dir, "ckpt.pt"))

        if tracer:
            tracer.start(X)
        _, loss = model(X, Y)
        if tracer:
            tracer.loss(loss)
        X, Y = get_batch("train")  # prefetch the next batch, as nanoGPT does
        loss.backward()
        if tracer:
            tracer.grads()
        if args.grad_clip != 0.0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        if tracer:
            tracer.updated()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt = t1 - t0
        t0 = t1
        if iter_num % args.log_interval == 0:
            print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1
        if iter_num > args.max_iters:
            break


if __name__ == "__main__":
    main()
