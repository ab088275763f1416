"""What preceded each loss spike of the small GPT of benchmarks/spiky_lm.py, as nanguard's own
report says it: the plain spiky setting (lr 0.1, AdamW betas 0.9 / 0.99, weight decay 0.1,
warm-up 50, 3000 steps) under `Guard(policy="observe")` with activations watched (so the
largest |attention logit| is measured every step), and per episode of report.json's
`spike_measures` the `before` ratios (largest value / own rolling mean in the 3 steps before
the jump) of every precursor, and the smallest ratio of the second moment there (`m2 min`: a
decayed Adam denominator). Nothing about training changes (observe).

Usage:
    python benchmarks/spiky_precursors.py                 # seeds 0, 1, 2
    python benchmarks/spiky_precursors.py --seeds 0 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from _spiky_model import GPT, Data  # noqa: E402
from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.config import WatchConfig  # noqa: E402
from nanguard.record.spikes import PRECURSORS  # noqa: E402


def episodes(seed: int, steps: int, data: Data) -> list[dict[str, Any]]:
    """report.json's loss spike episodes of one plain spiky run under observe."""
    torch.manual_seed(seed)
    model = GPT(vocab=data.vocab, context=data.context)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    g = torch.Generator().manual_seed(20_000 + seed)  # spiky_lm.py's batches
    with tempfile.TemporaryDirectory() as tmp:
        with nanguard.Guard(model, opt, config=GuardConfig(
                watch=WatchConfig(activations=True),
                record=RecordConfig(out=tmp, summary=False))) as guard:
            for _ in range(steps):
                x, y = data.batch(32, g)
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                guard.watch(loss=loss)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
        report = json.loads((Path(tmp) / "report.json").read_text())
    return list(report["spike_measures"]["episodes"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=3000)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    data = Data()
    short = {"grad_norm": "grad", "update_ratio": "upd", "momentum_norm": "m1",
             "second_moment_norm": "m2", "act_max": "act", "attn_logit_max": "attn"}
    print(f"{'seed':>4} {'start':>6} {'loss':>6} {'level':>6} "
          + " ".join(f"{short[k]:>11}" for k in PRECURSORS) + f"{'m2 min':>8}")
    out = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        eps = episodes(seed, args.steps, data)
        out[seed] = eps
        for e in eps:
            cells = []
            for k in PRECURSORS:
                b = e["before"].get(k)
                cells.append(f"{b['ratio']:6.2f}x @-{b['steps_before']}" if b else "-")
            low = (e["before"].get("second_moment_norm") or {}).get("min_ratio")
            print(f"{seed:>4} {e['start']:>6} {e['value']:>6.2f} {e['baseline']:>6.2f} "
                  + " ".join(f"{c:>11}" for c in cells)
                  + (f"{low:7.2f}x" if low is not None else f"{'-':>8}"), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
