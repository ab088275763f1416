"""Cost of measuring the largest |attention logit| (`WatchConfig.attention`) on the small GPT of
benchmarks/spiky_lm.py, where every step is sampled (`activations_every=1`).

Four copies of the same training in one process, stepped in interleaved blocks of `--block`
steps with the order rotated (load from other jobs falls on all alike): plain AdamW (`plain`),
`Guard(observe)` with activations watched and attention off (`act`), the same with attention
on (`attn`: the function mode over every forward, the logits recomputed for each
`scaled_dot_product_attention` call), and both sampled every 10th step (`attn10`). Ratios are
taken per block; the median is reported. The cost of the attention probe on a sampled step is
(attn - act) per step; a step that is not sampled pays nothing of it (no hook, no mode:
tests/test_precursors.py).

Usage:
    python benchmarks/attention_cost.py                  # 1000 steps each, blocks of 20
    python benchmarks/attention_cost.py --steps 2000 --block 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from _spiky_model import GPT, Data  # noqa: E402
from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.config import WatchConfig  # noqa: E402

CONFIGS = ("plain", "act", "attn", "attn10")


class Runner:
    """One configuration's model, optimizer, data stream and guard, stepped block by block."""

    def __init__(self, config: str, data: Data, tmp: str) -> None:
        torch.manual_seed(0)
        self.data = data
        self.model = GPT(vocab=data.vocab, context=data.context)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, betas=(0.9, 0.99),
                                     weight_decay=0.1)
        self.g = torch.Generator().manual_seed(20_000)
        self.guard = None
        if config != "plain":
            watch = WatchConfig(activations=True, attention=config != "act",
                                activations_every=10 if config == "attn10" else 1)
            self.guard = nanguard.Guard(self.model, self.opt, config=GuardConfig(
                watch=watch, record=RecordConfig(out=f"{tmp}/{config}", summary=False)))
        self.seconds = 0.0

    def steps(self, n: int) -> float:
        """Run `n` training steps; returns their wall seconds."""
        start = time.perf_counter()
        for _ in range(n):
            x, y = self.data.batch(32, self.g)
            loss = nn.functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
            if self.guard is not None:
                self.guard.watch(loss=loss)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        took = time.perf_counter() - start
        self.seconds += took
        return took


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="steps per configuration")
    p.add_argument("--block", type=int, default=20, help="steps per timed block")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = Data()
    with tempfile.TemporaryDirectory() as tmp:
        runners = {c: Runner(c, data, tmp) for c in CONFIGS}
        for r in runners.values():  # warm-up: first-call costs out of the timings
            r.steps(args.block)
            r.seconds = 0.0
        per_block: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for b in range(args.steps // args.block):
            k = b % len(CONFIGS)
            for c in CONFIGS[k:] + CONFIGS[:k]:  # interleaved, order rotated
                per_block[c].append(runners[c].steps(args.block))
        for r in runners.values():
            if r.guard is not None:
                r.guard.close()

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(per_block[a], per_block[b], strict=True))

    n = len(per_block["plain"]) * args.block
    out = {"steps": n, "block": args.block,
           "ms_per_step": {c: runners[c].seconds / n * 1e3 for c in CONFIGS},
           "act_vs_plain": ratio("act", "plain"), "attn_vs_plain": ratio("attn", "plain"),
           "attn_vs_act": ratio("attn", "act"), "attn10_vs_plain": ratio("attn10", "plain"),
           "attn10_vs_act": ratio("attn10", "act"),
           "attention_ms_per_sampled_step": statistics.median(
               (a - b) / args.block * 1e3
               for a, b in zip(per_block["attn"], per_block["act"], strict=True))}
    print(", ".join(f"{k} {v:.3f}" for k, v in out.items() if isinstance(v, float)))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
