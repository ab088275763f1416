"""Does heal's precursor detector fire before the loss spikes of benchmarks/spiky_lm.py? Plain
AdamW at the spiky setting (lr 0.1, beta2 0.99, weight decay 0.1, 3000 steps, seeds 0-2),
nothing changed: heal's detector (grad norm > 3x its EMA mean and > 6 EMA sigma, EMA 0.02,
50 warm-up steps) is run offline on the grad norms, and the loss episodes are found by the
independent median count of spiky_lm.py (`MedianEpisodes`). Prints, per seed, the episode
starts and the steps the detector flagged.

Usage:
    python benchmarks/spiky_lead.py
"""

import math
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _spiky_model import GPT, Data  # noqa: E402
from spiky_lm import MedianEpisodes  # noqa: E402


def flags_and_starts(seed: int, data: Data) -> tuple[list[int], list[int]]:
    """The steps heal's detector flags and the loss episode starts, in one plain run."""
    torch.manual_seed(seed)
    model = GPT(vocab=data.vocab, context=data.context)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    params = list(model.parameters())
    g = torch.Generator().manual_seed(20_000 + seed)
    mean = var = 0.0
    flags: list[int] = []
    starts: list[int] = []
    med = MedianEpisodes()
    for step in range(3000):
        x, y = data.batch(32, g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        norm = float(torch.linalg.vector_norm(torch.stack(
            torch._foreach_norm([p.grad for p in params if p.grad is not None]))))
        # heal's detector, offline, fed the unclipped norm (nothing is clipped here)
        if step >= 50 and norm > 3 * mean and norm > mean + 6 * math.sqrt(max(var, 0.0)):
            flags.append(step)
        a = 0.02 if step >= 50 else 1 / (step + 1)
        d = norm - mean
        mean += a * d
        var = (1 - a) * (var + a * d * d) if step else 0.0
        opt.step()
        sched.step()
        if step >= 200:
            before = med.episodes
            med.update(float(loss.detach()))
            if med.episodes > before:
                starts.append(step)
    return flags, starts


def main() -> None:
    torch.set_num_threads(1)
    data = Data()
    for seed in (0, 1, 2):
        flags, starts = flags_and_starts(seed, data)
        print(f"seed {seed}: loss episode starts {starts}; detector flags {flags}", flush=True)


if __name__ == "__main__":
    main()
