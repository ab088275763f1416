"""The names the docs' Python snippets take for granted (`model`, `optimizer`, `loader`, ...).

A snippet in the docs shows the lines that concern nanguard; the rest of a training script is
yours. The test of the docs (tests/docs/test_fenced_blocks.py) runs every snippet with the
names one of these functions returns, named by the marker `<!-- run with: NAME -->` above it,
so each snippet is run as written. To try one yourself:

    from snippets import loop        # with examples/ on sys.path
    globals().update(loop())
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

import nanguard


def loop() -> dict[str, Any]:
    """A plain PyTorch loop's pieces: a small MLP, SGD, MSE, 120 batches of synthetic data,
    and `train()`, which runs one epoch over them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.functional.mse_loss
    loader = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(120)]

    def train() -> None:
        for x, y in loader:
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    return {"torch": torch, "nn": nn, "nanguard": nanguard, "model": model,
            "optimizer": optimizer, "loss_fn": loss_fn, "loader": loader, "train": train}


def guarded() -> dict[str, Any]:
    """`loop()` with a `guard` that watched five steps, recording into runs/x."""
    names = loop()
    model, optimizer, loss_fn = names["model"], names["optimizer"], names["loss_fn"]
    config = nanguard.GuardConfig(record=nanguard.RecordConfig(summary=False))
    guard = nanguard.Guard(model, optimizer, out="runs/x", config=config)
    for x, y in names["loader"][:5]:
        loss = loss_fn(model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names["guard"] = guard
    return names


def trackers() -> dict[str, Any]:
    """`loop()` with a recorded run in runs/x (for the `write_run` lines) and an open `guard`
    (for the `stream` lines); W&B offline (no login), trackio writing under ./trackio."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", os.path.abspath("."))
    os.environ.setdefault("TRACKIO_DIR", os.path.abspath("trackio"))
    names = guarded()
    names["guard"].close()
    config = nanguard.GuardConfig(record=nanguard.RecordConfig(summary=False))
    names["guard"] = nanguard.Guard(names["model"], names["optimizer"], config=config)
    return names


def frameworks() -> dict[str, Any]:
    """Lightning and transformers: `lightning`, `Trainer`, and a tiny transformers `model`
    (a 2-layer GPT-2 made from its config: nothing is downloaded), its `args` and a data set
    `ds` of token ids."""
    import lightning
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2,
                                       n_head=2))
    ids = torch.randint(0, 64, (8, 16))
    ds = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir="hf_out", max_steps=2, per_device_train_batch_size=4,
                             report_to=[], use_cpu=True, save_strategy="no", logging_steps=1)
    return {"torch": torch, "nanguard": nanguard, "lightning": lightning, "Trainer": Trainer,
            "model": model, "args": args, "ds": ds}


def ddp() -> dict[str, Any]:
    """`loop()` under torch.distributed, as torchrun would start it but with one process (gloo,
    world size 1): `ddp_model` is the model wrapped in DistributedDataParallel. The snippet's
    caller destroys the process group (`close_ddp`)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    names = loop()
    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    names["ddp_model"] = DistributedDataParallel(names["model"])
    names["close_ddp"] = dist.destroy_process_group
    return names
