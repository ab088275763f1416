"""`heal`'s wall time against `clip_grad_norm_`'s on a ~4 ms CPU step, in one process,
interleaved (issue 40 item 5).

The small GPT of benchmarks/spiky_lm.py (batch 32, AdamW, the stable LR: nothing to act on, so
every configuration takes the same kind of step), each configuration with its own model and
optimizer from the same seed, trained on the same batches:

    plain     forward, backward, optimizer.step, zero_grad
    clip      + torch.nn.utils.clip_grad_norm_(1.0) after backward (the yardstick)
    observe   + Guard(model, opt) (policy "observe"), watch(loss=..., batch=(x, y)) every
              step, run store on: the guard that watches and never acts
    heal      the same under policy="heal" (as users get it): `heal - observe` is what acting
              adds (the pre-update read and judging, heal's own statistics)
    heal_nb   heal with watch(loss=...) only: no batch fingerprints

Each round times ONE step of every configuration, in a shuffled order, so that load from
other processes falls on all of them alike; warm-up rounds are discarded. Reported: the median
step (wall and process CPU time), the median of the paired per-round differences to plain,
and `x clip`: the configuration's median step over clip's (the target: heal <= 1.05x clip),
and heal's increment over observe (median of the paired differences).

Then, untimed, per configuration over `--count` steps: the tensor ops dispatched per step
(a `TorchDispatchMode` counting aten calls; `foreach` ops count once per call, however many
tensors they touch: what is reported beside is the number of passes over the parameters'
gradients / values those calls make) and the host reads made from nanguard's code per step
(`item`, `tolist`, `__float__`, ...: on a GPU each is a sync; the guard's packet read counts
once; reads on the run store's writer thread, off the step, are left out, as
tests/test_host_reads.py counts them), and the time spent inside heal's own code
(`Healer.before_update`, `after_update`, `observe`: its statistics and decisions) per step.

Usage:
    python benchmarks/heal_cost.py                  # the run recorded in BENCHMARKS.md
    python benchmarks/heal_cost.py --rounds 100     # shorter
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanguard  # noqa: E402
from _spiky_model import GPT, Data  # noqa: E402
from nanguard import GuardConfig, RecordConfig  # noqa: E402
from nanguard.recover.heal import Healer  # noqa: E402
from nanguard.watch.step import StepWatch  # noqa: E402

CONFIGS = ("plain", "clip", "observe", "heal", "heal_nb")
NANGUARD_DIR = str(Path(nanguard.__file__).resolve().parent)
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
         "__array__", "cpu")


def runner(name: str, data: Data, out: Path, seed: int) -> tuple[Callable[[Any], None], Any]:
    """One configuration's step function (and its guard, or None)."""
    torch.manual_seed(seed)
    model = GPT(vocab=data.vocab, context=data.context)
    opt = torch.optim.AdamW(model.parameters(), lr=0.003, betas=(0.9, 0.99), weight_decay=0.1)
    params = list(model.parameters())
    guard = None
    if name.startswith("heal") or name == "observe":
        guard = nanguard.Guard(model, opt, policy="observe" if name == "observe" else "heal",
                               config=GuardConfig(record=RecordConfig(out=out / name,
                                                                      summary=False)))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if guard is not None:
            guard.watch(loss=loss, batch=None if name == "heal_nb" else batch)
        loss.backward()
        if name == "clip":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, guard


class OpCount(TorchDispatchMode):
    """aten calls dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Reads:
    """Host reads from nanguard's code (the packet read counted once) while counting."""

    def __init__(self) -> None:
        self.n = 0
        self.by: Counter[str] = Counter()  # where each read was made: module:function
        self.on = False
        self.thread = threading.get_ident()
        self._inside = False
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> Reads:
        for name in READS:
            self._patch(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        original = StepWatch.read

        def read(watch: Any, t: Any) -> Any:  # the guard's read: counted by `host_reads`
            self._inside = True
            try:
                return original(watch, t)
            finally:
                self._inside = False

        self._patch(StepWatch, "read", read)
        return self

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _wrap(self, original: Any) -> Any:
        def counted(tensor: Any, *a: Any, **k: Any) -> Any:
            code = sys._getframe(1).f_code
            # The training thread's only: the run store's writer thread combines fingerprint
            # sums off the step (tests/test_host_reads.py counts the same way).
            if (self.on and not self._inside and code.co_filename.startswith(NANGUARD_DIR)
                    and threading.get_ident() == self.thread):
                self.n += 1
                where = Path(code.co_filename).relative_to(NANGUARD_DIR).with_suffix("")
                self.by[f"{'.'.join(where.parts)}:{code.co_name}"] += 1
            return original(tensor, *a, **k)

        return counted

    def __exit__(self, *exc: Any) -> None:
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)


class HealTime:
    """Time of the training thread inside heal's own code (`Healer`'s per-step methods): the
    median call of each, less what the timing itself costs (an empty method timed the same
    way), times its calls per step. Medians: a call the scheduler preempted is left out."""

    METHODS = ("before_update", "after_update", "observe")

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}
        self._undo: list[tuple[str, Any]] = []

    def _wrap(self, name: str, f: Any) -> Any:
        times = self.times.setdefault(name, [])

        def timed(obj: Any, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(obj, *a, **k)
            finally:
                times.append(time.perf_counter() - t0)
        return timed

    def __enter__(self) -> HealTime:
        for name in self.METHODS:
            original = getattr(Healer, name)
            self._undo.append((name, original))
            setattr(Healer, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._undo:
            setattr(Healer, name, original)

    def per_step(self, steps: int) -> float:
        """Seconds per step inside heal's own code."""
        probe = HealTime()
        empty = probe._wrap("empty", lambda obj: None)
        for _ in range(5000):
            empty(None)
        overhead = statistics.median(probe.times["empty"])
        return sum(max(0.0, statistics.median(t) - overhead) * len(t) / steps
                   for t in self.times.values() if t)


def count(name: str, data: Data, out: Path, steps: int) -> dict[str, Any]:
    """Ops, host reads and heal's own time per step of `name` (untimed)."""
    step, guard = runner(name, data, out / "count", 0)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):  # past the guard's first steps
        step(data.batch(32, g))
    mode, reads, own = OpCount(), Reads(), HealTime()
    # The guard's own reads (`StepWatch.read`, or the quiet lane's), as it counts them.
    before = guard.host_reads if guard is not None else 0
    with reads:
        reads.on = True
        for _ in range(steps):
            batch = data.batch(32, g)
            with mode:
                step(batch)
        reads.on = False
    if guard is not None:
        guard_reads = guard.host_reads - before
        reads.n += guard_reads
        reads.by["the guard's read (host_reads)"] += guard_reads
    with own:  # apart from the op count: its dispatch mode would be timed too
        for _ in range(steps):
            step(data.batch(32, g))
    if guard is not None:
        guard.close()
    ops = {k: v / steps for k, v in mode.ops.items()}
    return {"ops": round(sum(ops.values()), 1), "reads": reads.n / steps,
            "heal_own_us": 1e6 * own.per_step(steps),
            "reads_by": {k: v / steps for k, v in reads.by.most_common()},
            "foreach": {k: v for k, v in sorted(ops.items()) if k.startswith("_foreach")},
            "ops_by": ops}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--count", type=int, default=20, help="steps counted (ops, reads)")
    p.add_argument("--quick", action="store_true", help="a few rounds: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.warmup, args.count = 10, 2, 2
    torch.set_num_threads(1)
    data = Data()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        steps = {c: runner(c, data, out, 0) for c in CONFIGS}
        g = torch.Generator().manual_seed(2)
        wall: dict[str, list[float]] = {c: [] for c in CONFIGS}
        cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
        for r in range(args.warmup + args.rounds):
            batch = data.batch(32, g)
            order = list(CONFIGS)
            rng.shuffle(order)
            for c in order:
                t0, c0 = time.perf_counter(), time.process_time()
                steps[c][0](batch)
                t1, c1 = time.perf_counter(), time.process_time()
                if r >= args.warmup:
                    wall[c].append(1000 * (t1 - t0))
                    cpu[c].append(1000 * (c1 - c0))
        for _, guard in steps.values():
            if guard is not None:
                guard.close()
        counts = {c: count(c, data, out, args.count) for c in CONFIGS}
    res: dict[str, Any] = {}
    for c in CONFIGS:
        res[c] = {"ms": statistics.median(wall[c]), "cpu_ms": statistics.median(cpu[c]),
                  "added_ms": statistics.median(a - b for a, b in zip(wall[c], wall["plain"],
                                                                      strict=True)),
                  "added_cpu_ms": statistics.median(a - b for a, b in zip(cpu[c], cpu["plain"],
                                                                          strict=True)),
                  **counts[c]}
    for c in CONFIGS:
        res[c]["x_clip"] = res[c]["ms"] / res["clip"]["ms"]
        res[c]["x_clip_cpu"] = res[c]["cpu_ms"] / res["clip"]["cpu_ms"]
    print(f"{'config':<9}{'ms':>8}{'cpu ms':>8}{'added':>8}{'(cpu)':>8}{'x clip':>8}"
          f"{'(cpu)':>7}{'ops':>7}{'reads':>7}  foreach calls per step")
    for c, r in res.items():
        print(f"{c:<9}{r['ms']:>8.3f}{r['cpu_ms']:>8.3f}{r['added_ms']:>+8.3f}"
              f"{r['added_cpu_ms']:>+8.3f}{r['x_clip']:>7.3f}x{r['x_clip_cpu']:>6.3f}x"
              f"{r['ops']:>7.1f}{r['reads']:>7.2f}  "
              + ", ".join(f"{k} {v:g}" for k, v in r["foreach"].items()))
    inc = [a - b for a, b in zip(wall["heal"], wall["observe"], strict=True)]
    inc_cpu = [a - b for a, b in zip(cpu["heal"], cpu["observe"], strict=True)]
    res["heal_over_observe"] = {"ms": statistics.median(inc), "cpu_ms": statistics.median(inc_cpu),
                                "heal_own_us": res["heal"]["heal_own_us"]}
    print(f"heal - observe (paired medians): {res['heal_over_observe']['ms']:+.3f} ms "
          f"(cpu {res['heal_over_observe']['cpu_ms']:+.3f}); inside heal's own code "
          f"{res['heal']['heal_own_us']:.1f} us per step (counted apart)")
    base = res["plain"]["ops_by"]
    for c in CONFIGS:
        r = res[c]
        more = sorted(((v - base.get(k, 0.0), k) for k, v in r["ops_by"].items()), reverse=True)
        if c != "plain":
            print(f"{c} ops per step over plain's: " + ", ".join(
                f"{k} {d:+.3g}" for d, k in more[:10] if d > 0))
        if r["reads_by"]:
            print(f"{c} reads per step: " + ", ".join(f"{k} {v:g}"
                                                      for k, v in r["reads_by"].items()))
    print(json.dumps({"rounds": args.rounds, "warmup": args.warmup,
                      "torch": torch.__version__, "results": res}))


if __name__ == "__main__":
    main()
