"""The small GPT LM and the data of benchmarks/spiky_lm.py (kept apart so that file holds the
remedies and the measurement only)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a GELU MLP (4x wide)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.ln2 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(
            2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and learned position embeddings, `layers` blocks, a final LayerNorm, a linear
    head (untied)."""

    def __init__(self, *, vocab: int, context: int, d: int = 32, layers: int = 2,
                 heads: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(context, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.emb(tokens) + self.pos[:tokens.shape[1]])))


class Data:
    """A token stream from a sparse random Markov chain (each token has `successors` likely
    next tokens, picked uniformly; with probability `noise` any token instead), cut into
    sequences of `context` + 1 tokens: training batches from the first half of the stream,
    `n_val` validation sequences from the second."""

    def __init__(self, *, vocab: int = 64, context: int = 16, successors: int = 2,
                 noise: float = 0.05, tokens: int = 60_000, n_val: int = 256,
                 seed: int = 1234) -> None:
        self.vocab, self.context = vocab, context
        rng = np.random.default_rng(seed)
        succ = rng.integers(0, vocab, (vocab, successors))
        pick = rng.integers(0, successors, tokens)
        rand = rng.integers(0, vocab, tokens)
        flip = rng.random(tokens) < noise
        out = np.empty(tokens, np.int64)
        out[0] = 0
        for i in range(1, tokens):
            out[i] = rand[i] if flip[i] else succ[out[i - 1], pick[i]]
        self.stream = torch.from_numpy(out)
        half = tokens // 2
        starts = torch.arange(n_val) * (half // n_val) + half
        self.val = self._cut(starts)

    def _cut(self, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.stream[starts[:, None] + torch.arange(self.context + 1)]
        return seq[:, :-1], seq[:, 1:]

    def batch(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`n` fresh sequences from the first half of the stream."""
        half = len(self.stream) // 2
        return self._cut(torch.randint(0, half - self.context - 1, (n,), generator=g))

    @torch.no_grad()
    def val_loss(self, model: nn.Module) -> float:
        """Mean next-token cross-entropy on the validation sequences (nan if non-finite)."""
        x, y = self.val
        return float(nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()))
