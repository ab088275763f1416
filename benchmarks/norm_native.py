"""What a compiled or fused piece would give the norm/packet step (issue 26 item 3), measured.

The watch's tensor work on a quiet step is one norm pass over the gradients before the update,
one over the parameters and optimizer state after it, and one host read of the results. This
benchmark times ways of doing that on the workloads of `host_cost.py` (logreg: 2 tensors, mlp:
8, blocks: 400), after a real backward and optimizer step, each variant timed in the same
rounds in a shuffled order (medians, microseconds per step for both passes and the read):

    per_tensor      a Python loop of `torch.linalg.vector_norm`, `.item()` each (the naive way)
    foreach_list    `torch._foreach_norm` per pass, `torch.stack` of both, `.tolist()`
                    (what the guard's packet does today, without its bookkeeping)
    foreach_buffer  `torch._foreach_norm` per pass, copied into one preallocated float32 buffer
                    (`torch.stack(..., out=buf)`), read as a NumPy view: no Python float per
                    value on the host
    compiled        `torch.compile` (inductor, CPU) of the function that computes both passes'
                    norms into one flat tensor, read as a NumPy view; compile time reported
                    apart (paid once per signature)
    clip            `torch.nn.utils.clip_grad_norm_` with a max_norm never reached (the
                    yardstick of the targets)

Usage:
    python benchmarks/norm_native.py                        # the run recorded in BENCHMARKS.md
    python benchmarks/norm_native.py --steps 50 --no-compile
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import host_cost  # noqa: E402 - the same workloads, side by side


def _state(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v for p in params for k, v in opt.state[p].items()
            if k != "step" and isinstance(v, torch.Tensor) and v.shape == p.shape]


def variants(params: list[torch.Tensor], opt: torch.optim.Optimizer, compile_: bool
             ) -> tuple[dict[str, Callable[[], object]], float | None]:
    grads = [p.grad for p in params if p.grad is not None]
    post = params + _state(opt, params)
    n = len(grads) + len(post)
    buf = torch.empty(n, dtype=torch.float32)
    view = buf.numpy()

    def per_tensor() -> object:
        return [torch.linalg.vector_norm(t, dtype=torch.float32).item() for t in grads + post]

    def foreach_list() -> object:
        a = torch._foreach_norm(grads, 2, dtype=torch.float32)
        b = torch._foreach_norm(post, 2, dtype=torch.float32)
        return torch.stack([*a, *b]).tolist()

    def foreach_buffer() -> object:
        a = torch._foreach_norm(grads, 2, dtype=torch.float32)
        b = torch._foreach_norm(post, 2, dtype=torch.float32)
        torch.stack([*a, *b], out=buf)
        return view  # the host's flat array: no per-value objects

    def clip() -> object:
        return torch.nn.utils.clip_grad_norm_(params, 1e30)

    out: dict[str, Callable[[], object]] = {"per_tensor": per_tensor,
                                            "foreach_list": foreach_list,
                                            "foreach_buffer": foreach_buffer, "clip": clip}
    compile_s = None
    if compile_:
        def norms(g: list[torch.Tensor], p: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([*torch._foreach_norm(g, 2, dtype=torch.float32),
                                *torch._foreach_norm(p, 2, dtype=torch.float32)])

        fn = torch.compile(norms, dynamic=False)
        t0 = time.perf_counter()
        fn(grads, post)
        compile_s = time.perf_counter() - t0

        def compiled() -> object:
            return fn(grads, post).numpy()

        out["compiled"] = compiled
    return out, compile_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--workloads", default="logreg,mlp,blocks")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    builders = {"logreg": host_cost.logreg, "mlp": host_cost.mlp, "blocks": host_cost.blocks}
    result: dict[str, object] = {}
    with torch.no_grad():  # as in the guard's hooks: norms are not part of the graph
        _run(args, builders, result)
    result["steps"] = args.steps
    print(json.dumps(result))
    return 0


def _run(args: argparse.Namespace, builders: dict[str, Callable[[int], host_cost.Workload]],
         result: dict[str, object]) -> None:
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        wl = builders[name](0)
        model, opt = wl.build()
        params = [p for p in model.parameters() if p.requires_grad]
        x, y = wl.batches[0]
        with torch.enable_grad():
            wl.loss(model(x), y).backward()
        opt.step()  # optimizer state exists
        fns, compile_s = variants(params, opt, not args.no_compile)
        # The results agree (same norms, same order) before anything is timed.
        ref = torch.tensor(fns["foreach_list"]())
        assert torch.equal(torch.from_numpy(fns["foreach_buffer"]()), ref)  # type: ignore[arg-type]
        if "compiled" in fns:  # its own reduction order: equal to float32 rounding
            torch.testing.assert_close(torch.from_numpy(fns["compiled"]()), ref)  # type: ignore[arg-type]
        times: dict[str, list[float]] = {k: [] for k in fns}
        order = list(fns)
        shuffle = random.Random(0)
        for r in range(args.warmup + args.steps):
            shuffle.shuffle(order)
            for k in order:
                t0 = time.perf_counter()
                fns[k]()
                dt = time.perf_counter() - t0
                if r >= args.warmup:
                    times[k].append(dt)
        med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
        print(f"\n{name}: {len(params)} parameter tensors; microseconds per step (median)")
        for k, v in med.items():
            print(f"  {k:<16} {v:>9.1f} us   {v / med['clip']:>6.2f}x clip")
        if compile_s is not None:
            print(f"  compile (once per signature): {compile_s:.1f} s")
        result[name] = {**{k: round(v, 1) for k, v in med.items()},
                        "compile_s": None if compile_s is None else round(compile_s, 2)}


if __name__ == "__main__":
    raise SystemExit(main())
