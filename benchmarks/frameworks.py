"""Overhead of each framework integration against the framework alone, measured in one run.

Three pairs train the same small GPT-2 (built from a config, random init, CPU) on the same
token batches with AdamW:

    lightning     lightning.Trainer.fit            vs  + NanguardCallback(out=<tmp>)
    transformers  transformers.Trainer.train       vs  + NanguardCallback(out=<tmp>)
    accelerate    an Accelerate loop (prepare, backward, step)
                                                   vs  + Guard(model, opt.optimizer) and
                                                       guard.watch(loss=, batch=) (the recipe)

Each configuration is the integration as users get it: default options, run store on, summary
off (it prints once, at the end). A round runs one short training of each of the six
configurations in a shuffled order (interleaved: load from other processes hits all of them
alike); the time of every optimizer step is taken from step end to step end by a callback (the
loop itself for Accelerate), the first `--warmup` steps of each training are dropped. Reported
per pair: median ms per step without and with nanguard, and the ratio of medians, from wall
time (perf_counter) and process CPU time (process_time, steadier on a shared machine).

The last line printed is one JSON object.

Usage:
    python benchmarks/frameworks.py                  # the run recorded in BENCHMARKS.md
    python benchmarks/frameworks.py --rounds 3 --steps 20
    python benchmarks/frameworks.py --quick          # a smoke test, not a measurement
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import nanguard
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import nanguard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lightning.pytorch as pl  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.integrations.lightning import NanguardCallback as LightningCallback  # noqa: E402
from nanguard.integrations.transformers import NanguardCallback as HFCallback  # noqa: E402
from overhead import machine  # noqa: E402

QUIET = GuardConfig(record=RecordConfig(summary=False))
Clock = list[tuple[float, float]]  # (wall, cpu) at each step end


def _tick(clock: Clock) -> None:
    clock.append((time.perf_counter(), time.process_time()))


class Shape:
    def __init__(self, quick: bool) -> None:
        self.layers, self.embd, self.seq, self.batch, self.vocab = (
            (1, 32, 16, 4, 64) if quick else (2, 128, 64, 8, 512))

    def model(self) -> GPT2LMHeadModel:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(
            n_layer=self.layers, n_head=4, n_embd=self.embd, vocab_size=self.vocab,
            n_positions=self.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

    def tokens(self, steps: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1)
        return torch.randint(0, self.vocab, (steps * self.batch, self.seq), generator=g)


# ----------------------------------------------------------------------------- Lightning

class _LitLM(pl.LightningModule):
    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.model = model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss: torch.Tensor = self.model(input_ids=ids, labels=ids).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _LitClock(pl.Callback):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_train_batch_end(self, *args: Any) -> None:
        _tick(self.clock)


def lightning_run(shape: Shape, steps: int, guarded: bool, out: Path) -> Clock:
    clock: Clock = []
    callbacks: list[Any] = [LightningCallback(out=out, config=QUIET)] if guarded else []
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[*callbacks, _LitClock(clock)])
    data = DataLoader(TensorDataset(shape.tokens(steps)), batch_size=shape.batch)
    _tick(clock)
    trainer.fit(_LitLM(shape.model()), data)
    return clock


# -------------------------------------------------------------------------- transformers

class _Ids(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _HFClock(TrainerCallback):
    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    def on_step_end(self, *args: Any, **kwargs: Any) -> None:
        _tick(self.clock)


def transformers_run(shape: Shape, steps: int, guarded: bool, out: Path) -> Clock:
    clock: Clock = []
    args = TrainingArguments(output_dir=str(out / "hf"), per_device_train_batch_size=shape.batch,
                             max_steps=steps, learning_rate=1e-3, report_to=[],
                             save_strategy="no", logging_steps=10**6, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    callbacks: list[Any] = [HFCallback(out=out / "run", config=QUIET)] if guarded else []
    trainer = Trainer(model=shape.model(), args=args, train_dataset=_Ids(shape.tokens(steps)),
                      callbacks=[*callbacks, _HFClock(clock)])
    _tick(clock)
    trainer.train()
    return clock


# ---------------------------------------------------------------------------- Accelerate

def accelerate_run(shape: Shape, steps: int, guarded: bool, out: Path) -> Clock:
    clock: Clock = []
    accelerator = Accelerator(cpu=True)
    model = shape.model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = DataLoader(TensorDataset(shape.tokens(steps)), batch_size=shape.batch)
    model, opt, data = accelerator.prepare(model, opt, data)
    guard = nanguard.Guard(model, opt.optimizer, out=out, config=QUIET) if guarded else None
    _tick(clock)
    for (ids,) in data:
        loss = model(input_ids=ids, labels=ids).loss
        if guard is not None:
            guard.watch(loss=loss, batch=ids)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        _tick(clock)
    if guard is not None:
        guard.close()
    return clock


# --------------------------------------------------------------------------------- driver

RUNS: dict[str, Callable[[Shape, int, bool, Path], Clock]] = {
    "lightning": lightning_run, "transformers": transformers_run, "accelerate": accelerate_run}


def measure(shape: Shape, names: list[str], rounds: int, steps: int, warmup: int,
            seed: int, tmp: Path) -> dict[tuple[str, bool], dict[str, list[float]]]:
    """Per-step (wall, cpu) seconds of every configuration, over interleaved rounds."""
    times: dict[tuple[str, bool], dict[str, list[float]]] = {
        (n, g): {"wall": [], "cpu": []} for n in names for g in (False, True)}
    order = list(times)
    rng = random.Random(seed)
    for r in range(rounds):
        rng.shuffle(order)
        for name, guarded in order:
            out = tmp / f"{name}-{int(guarded)}-{r}"
            clock = RUNS[name](shape, warmup + steps, guarded, out)
            deltas = list(zip(clock, clock[1:], strict=False))[warmup:]
            times[(name, guarded)]["wall"] += [b[0] - a[0] for a, b in deltas]
            times[(name, guarded)]["cpu"] += [b[1] - a[1] for a, b in deltas]
    return times


def summarize(times: dict[tuple[str, bool], dict[str, list[float]]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in dict.fromkeys(n for n, _ in times):
        row: dict[str, float] = {}
        for kind in ("wall", "cpu"):
            plain = statistics.median(times[(name, False)][kind])
            guarded = statistics.median(times[(name, True)][kind])
            row[f"{kind}_plain_ms"] = round(plain * 1e3, 3)
            row[f"{kind}_nanguard_ms"] = round(guarded * 1e3, 3)
            row[f"{kind}_ratio"] = round(guarded / plain, 4) if plain > 0 else float("nan")
        row["steps_timed"] = len(times[(name, False)]["wall"])
        result[name] = row
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30, help="timed steps per training")
    p.add_argument("--warmup", type=int, default=5, help="steps dropped per training")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frameworks", default=",".join(RUNS))
    p.add_argument("--quick", action="store_true", help="tiny model, one round (smoke test)")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, min(args.steps, 3), min(args.warmup, 1)
    names = [n for n in args.frameworks.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        p.error(f"unknown framework(s) {', '.join(unknown)}; choose from {', '.join(RUNS)}")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    for log in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(log).setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    shape = Shape(args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        times = measure(shape, names, args.rounds, args.steps, args.warmup, args.seed,
                        Path(tmp))
    result = summarize(times)
    for name, row in result.items():
        print(f"{name:13s} plain {row['wall_plain_ms']:8.2f} ms  nanguard "
              f"{row['wall_nanguard_ms']:8.2f} ms  x{row['wall_ratio']:.3f} wall   "
              f"x{row['cpu_ratio']:.3f} cpu   ({row['steps_timed']} steps each)")
    result.update(machine=machine(args.threads, torch.device("cpu")), rounds=args.rounds,
                  steps=args.steps, warmup=args.warmup, load=os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
