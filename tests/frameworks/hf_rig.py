"""A tiny transformers rig for the Trainer adapter tests: a 2-layer GPT-2 built from a config
(random init, nothing downloaded) fed float `inputs_embeds`, so a data row can hold a NaN; rows
are taken in order (`BATCH` per step), so row `r` lands in step `r // BATCH`."""

from __future__ import annotations

import warnings

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from nanguard import GuardConfig, RecordConfig

warnings.filterwarnings("ignore", ".*torch_dtype.*")
QUIET = GuardConfig(record=RecordConfig(summary=False))
BATCH, SEQ, EMBD, VOCAB = 4, 8, 16, 32


class Embeds(Dataset):
    """Float input embeddings and next-token labels; row `bad_row` holds a NaN."""

    def __init__(self, n: int, bad_row: int | None = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, SEQ, EMBD, generator=g)
        self.y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if bad_row is not None:
            self.x[bad_row, 3, 5] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": self.x[i], "labels": self.y[i]}


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=EMBD, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_args(tmp_path, steps: int, **kw) -> TrainingArguments:
    args = dict(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=BATCH,
                max_steps=steps, learning_rate=1e-3, report_to=[], save_strategy="no",
                logging_steps=1, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
                seed=0)
    if "train_sampling_strategy" in TrainingArguments.__dataclass_fields__:
        args["train_sampling_strategy"] = "sequential"
    args.update(kw)
    return TrainingArguments(**args)


def train(tmp_path, steps, data, callbacks=(), cls=Trainer, **kw):
    model = make_model()
    trainer = cls(model=model, args=make_args(tmp_path, steps), train_dataset=data,
                  callbacks=list(callbacks), **kw)
    trainer.train()
    return model, trainer
