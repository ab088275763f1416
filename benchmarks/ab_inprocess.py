"""Before / after of the guard's cost in ONE process: an older nanguard against this one.

On a shared 2-core machine, separate runs of host_cost.py drift by 30% or more (the plain step
itself changes speed from run to run), which buries a 5-10% change. Here both versions train
side by side: the older checkout's `src/nanguard` is copied into a temporary folder as the
package `nanguard_before` (its imports renamed), and each round times one step of every
configuration, shuffled:

    plain     forward, backward, optimizer.step, zero_grad
    clip      + torch.nn.utils.clip_grad_norm_ (the yardstick of issue 12)
    before    + the older Guard and watch(loss=..., batch=(x, y)), run store on
    after     + this checkout's Guard, the same

on host_cost.py's workloads, overhead.py's transformer LM (`--workloads lm`; ~0.6 s a step
here, so fewer rounds) and the small GPT of spiky_lm.py with AdamW (`--workloads gpt`, ~3.5 ms a
step: issue 30's wall-time target). Reported per workload: the plain step (median) and, from process
CPU time, the median of the paired per-round differences to plain; `after / before` is the
ratio of those added times.

Usage:
    git worktree add /tmp/before <commit>
    python benchmarks/ab_inprocess.py --before /tmp/before/src --rounds 500
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cost import Workload, blocks, logreg, mlp  # noqa: E402
from overhead import lm_workload  # noqa: E402

try:
    import nanguard
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import nanguard

CONFIGS = ("plain", "clip", "before", "after")


def load_before(src: Path, into: Path) -> ModuleType:
    """`src/nanguard` of another checkout, importable as `nanguard_before`."""
    pkg = into / "nanguard_before"
    shutil.copytree(src / "nanguard", pkg)
    pattern = re.compile(r"\b(from|import) nanguard(?=[. ])")
    for path in pkg.rglob("*.py"):
        text = path.read_text()
        text = pattern.sub(r"\1 nanguard_before", text).replace('"nanguard.', '"nanguard_before.')
        path.write_text(text)
    sys.path.insert(0, str(into))
    return importlib.import_module("nanguard_before")


def gpt(seed: int) -> Workload:
    """The small GPT of spiky_lm.py at its stable setting (AdamW, 29 parameter tensors)."""
    from _spiky_model import GPT, Data

    data = Data()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = GPT(vocab=data.vocab, context=data.context)
        return model, torch.optim.AdamW(model.parameters(), lr=0.003, betas=(0.9, 0.99),
                                        weight_decay=0.1)

    g = torch.Generator().manual_seed(20_000 + seed)
    batches = [data.batch(32, g) for _ in range(8)]
    return Workload("gpt", build, batches,
                    lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1),
                                                                     y.flatten()),
                    "the small GPT of spiky_lm.py, AdamW")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="the older checkout's src folder")
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--workloads", default="logreg,mlp,blocks")
    ap.add_argument("--policy", default="observe",
                    help="both guards' policy (e.g. heal: issue 30's wall-time target)")
    args = ap.parse_args(argv)
    src = Path(args.before)
    if not (src / "nanguard" / "guard.py").is_file():
        ap.error(f"{str(src)!r} holds no nanguard package (give the checkout's src folder)")
    torch.set_num_threads(1)
    builders = {"logreg": logreg, "mlp": mlp, "blocks": blocks,
                "lm": lambda seed: lm_workload(False, seed, torch.device("cpu")), "gpt": gpt}
    result: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="nanguard_ab_") as tmp:
        before = load_before(src, Path(tmp) / "pkg")
        print(f"before: {src}  after: {Path(nanguard.__file__).parent}; torch "
              f"{torch.__version__}, 1 thread, policy {args.policy}, {args.rounds} rounds + "
              f"{args.warmup} warm-up, "
              "interleaved; process CPU time")
        for name in args.workloads.split(","):
            wl = builders[name](0)
            runs = {}
            for cfg in CONFIGS:
                model, opt = wl.build()
                lib = {"before": before, "after": nanguard}.get(cfg)
                guard = None if lib is None else lib.Guard(
                    model, opt, out=str(Path(tmp) / f"{name}-{cfg}"),
                    config=lib.GuardConfig(policy=args.policy,
                                           record=lib.RecordConfig(summary=False)))
                runs[cfg] = (model, opt, list(model.parameters()), guard, [])
            order = list(CONFIGS)
            shuffle = random.Random(0)
            for r in range(args.warmup + args.rounds):
                shuffle.shuffle(order)
                x, y = wl.batches[r % len(wl.batches)]
                for cfg in order:
                    model, opt, params, guard, times = runs[cfg]
                    t = time.process_time()
                    loss = wl.loss(model(x), y)
                    if guard is not None:
                        guard.watch(loss=loss, batch=(x, y))
                    loss.backward()
                    if cfg == "clip":
                        torch.nn.utils.clip_grad_norm_(params, 1.0)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if r >= args.warmup:
                        times.append(time.process_time() - t)
            for _, _, _, guard, _ in runs.values():
                if guard is not None:
                    guard.close()
            plain = runs["plain"][4]
            added = {cfg: statistics.median(a - b for a, b in zip(runs[cfg][4], plain,
                                                                    strict=True))
                     for cfg in CONFIGS[1:]}
            base = statistics.median(plain)
            row = {"plain_ms": base * 1e3, **{f"{c}_added_ms": v * 1e3 for c, v in added.items()},
                   "after_over_before": added["after"] / added["before"]}
            print(f"{name}: plain {base * 1e3:.3f} ms; added: clip {added['clip'] * 1e3:+.3f}, "
                  f"before {added['before'] * 1e3:+.3f} ({added['before'] / added['clip']:.2f}x "
                  f"clip), after {added['after'] * 1e3:+.3f} ({added['after'] / added['clip']:.2f}x"
                  f" clip); after / before {row['after_over_before']:.2f}")
            result[name] = {k: round(v, 4) for k, v in row.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
