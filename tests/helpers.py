"""Tiny, seeded, healthy training tasks shared by the core-guard tests.

Each `make_*` returns a `Task`: a model, a seeded batch stream with learnable structure and a
loss function. `make_optimizer` and `warmup_cosine` build the optimizers and LR schedules the
false-alarm tests cover; `train` runs the plain loop the Guard docstring documents, under an
optional guard. Everything is CPU, float32 and deterministic for a given seed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True)
class Task:
    """A model with its data stream and loss."""

    name: str
    model: nn.Module
    batches: Callable[[int], Iterator[Batch]]
    """`batches(steps)`: a fresh seeded stream of `steps` batches."""
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------- MLP


def make_mlp(seed: int, *, dim: int = 16, batch: int = 32) -> Task:
    """MLP regression of a fixed random two-layer teacher, with label noise."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1)
    )

    def batches(steps: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(10_000 + seed)
        w1 = torch.randn(dim, 32, generator=g) / math.sqrt(dim)
        w2 = torch.randn(32, 1, generator=g) / math.sqrt(32)
        for _ in range(steps):
            x = torch.randn(batch, dim, generator=g)
            y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(batch, 1, generator=g)
            yield x, y

    return Task(name="mlp", model=model, batches=batches, loss_fn=nn.functional.mse_loss)


# ---------------------------------------------------------------------------- CNN


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head, 1x12x12 inputs, 4 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(16 * 3 * 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def make_cnn(seed: int, *, batch: int = 32) -> Task:
    """Which quadrant of a noisy 12x12 image holds a bright 3x3 blob (4 classes)."""
    torch.manual_seed(seed)
    model = SmallCNN()

    def batches(steps: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(20_000 + seed)
        for _ in range(steps):
            y = torch.randint(0, 4, (batch,), generator=g)
            x = 0.5 * torch.randn(batch, 1, 12, 12, generator=g)
            r0 = (y // 2) * 6 + torch.randint(0, 4, (batch,), generator=g)
            c0 = (y % 2) * 6 + torch.randint(0, 4, (batch,), generator=g)
            for i in range(batch):
                x[i, 0, r0[i] : r0[i] + 3, c0[i] : c0[i] + 3] += 2.0
            yield x, y

    return Task(name="cnn", model=model, batches=batches, loss_fn=nn.functional.cross_entropy)


# ---------------------------------------------------------------------------- transformer LM


class TinyLM(nn.Module):
    """Causal transformer LM: embeddings, `nn.TransformerEncoder` with a causal mask, head."""

    def __init__(self, vocab: int = 64, d_model: int = 32, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seq, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tok(idx) + self.pos[:t]
        h = self.encoder(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_lm(seed: int, *, vocab: int = 64, seq: int = 16, batch: int = 16) -> Task:
    """Next-token prediction on a sparse random Markov chain (4 likely successors per token)."""
    torch.manual_seed(seed)
    model = TinyLM(vocab=vocab, seq=seq)

    def batches(steps: int) -> Iterator[Batch]:
        g = torch.Generator().manual_seed(30_000 + seed)
        succ = torch.randint(0, vocab, (vocab, 4), generator=g)
        for _ in range(steps):
            tokens = torch.empty(batch, seq + 1, dtype=torch.long)
            tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
            for t in range(seq):
                pick = torch.randint(0, 4, (batch,), generator=g)
                nxt = succ[tokens[:, t], pick]
                noise = torch.rand(batch, generator=g) < 0.05
                tokens[:, t + 1] = torch.where(
                    noise, torch.randint(0, vocab, (batch,), generator=g), nxt
                )
            yield tokens[:, :-1], tokens[:, 1:]

    return Task(name="lm", model=model, batches=batches, loss_fn=_lm_loss)


# ---------------------------------------------------------------------------- training


def make_optimizer(kind: str, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """`adam`, `adamw` or `sgd` (momentum 0.9, Nesterov off)."""
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    raise AssertionError(f"unknown optimizer kind {kind!r}")


def warmup_cosine(
    optimizer: torch.optim.Optimizer, steps: int, warmup: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up from ~0 over `warmup` steps, then cosine decay to 0 at `steps`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def train(
    task: Task,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    guard: Any = None,
    scheduler: Any = None,
    batches: Iterator[Batch] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> list[float]:
    """The plain loop from the Guard docstring. Returns the host loss of every step.

    `on_step(step)` runs after each `optimizer.step()`.
    """
    losses = []
    for step, (x, y) in enumerate(batches if batches is not None else task.batches(steps)):
        loss = task.loss_fn(task.model(x), y)
        if guard is not None:
            guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses


ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a Python process a test starts: this checkout's `src` first on the
    path (nanguard need not be installed) and one OpenMP thread, plus `extra`."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def run_python(cwd: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in `cwd` with `child_env()`: a training script alone, or
    `-m nanguard run ...`."""
    env = child_env()
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
