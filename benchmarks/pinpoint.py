"""Pinpoint benchmark: what each tool names on every scenario of the suite, and replay cost.

Tools compared on the failing step of each scenario (`tests/scenarios`):

* nanguard: `find_origin` (phase, module, aten op). A hit needs all three right.
* `torch.autograd.detect_anomaly`: the autograd node in its error (backward only, NaN only).
  A hit when that node is the expected one (`node`), or is the expected op's backward
  (`LogBackward0` for `aten.log`).
* forward hooks: transformers' `DebugUnderflowOverflow` when importable (`pip install
  nanguard[bench]`); otherwise the labelled ~30-line equivalent below (forward hooks on every
  module, first module whose output holds inf/nan). A hit when the expected phase is forward
  and the module is right (it cannot see an op, backward or the optimizer).

Replay cost: `replay_step` (restore + the step under the checker) over one plain step, medians.

    PYTHONPATH=src python benchmarks/pinpoint.py

The last line printed is one JSON object: per-tool hit counts and the max replay-cost ratio.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from nanguard.pinpoint import StepSnapshot, find_origin, replay_step  # noqa: E402
from scenarios import SCENARIOS, load  # noqa: E402


def nanguard_names(mod: Any) -> tuple[str, bool]:
    b = mod.build()
    o = find_origin(b.step, model=b.model, optimizer=b.notes.get("optimizers", b.optimizer),
                    batch=b.batch)
    if o is None:
        return "-", False
    e = mod.EXPECTED
    return f"{o.phase} {o.module} {o.op}", (o.phase, o.module, o.op) == (
        e["phase"], e["module"], e["op"])


def anomaly_names(mod: Any) -> tuple[str, bool]:
    b = mod.build()
    node = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                b.step()
        except RuntimeError as err:
            m = re.search(r"Function '(\w+)' returned nan", str(err))
            node = m.group(1) if m else None
    if node is None:
        return "-", False
    e = mod.EXPECTED
    fwd = re.sub(r"Backward\d*$", "", node).lower()
    op = (e["op"] or "").removeprefix("aten.").lstrip("_").replace("_", "")
    return f"backward {node}", node == e.get("node") or (fwd == op and "node" not in e)


# --- forward-hook debugger ----------------------------------------------------------------
# A faithful stand-in for transformers' DebugUnderflowOverflow (used when transformers is not
# installed): a forward hook on every module; after each forward, the output is checked for
# inf/nan with a host read per tensor; the first module found is reported (hooks fire
# innermost first). No backward, no optimizer, no op.
class ForwardHookDebugger:
    def __init__(self, model: nn.Module) -> None:
        self.first: str | None = None
        self.handles = [m.register_forward_hook(self._hook(name))
                        for name, m in model.named_modules()]

    def _hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            outs = output if isinstance(output, (tuple, list)) else (output,)
            for t in outs:
                if (isinstance(t, torch.Tensor) and t.is_floating_point()
                        and self.first is None
                        and (bool(torch.isnan(t).any()) or bool(torch.isinf(t).any()))):
                    self.first = name
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def hooks_names(mod: Any) -> tuple[str, bool, str]:
    b = mod.build()
    try:
        from transformers.debug_utils import DebugUnderflowOverflow  # type: ignore
    except ImportError:
        DebugUnderflowOverflow = None  # noqa: N806
    if DebugUnderflowOverflow is not None:
        tool = "transformers DebugUnderflowOverflow"
        DebugUnderflowOverflow(b.model, abort_after_batch_num=None)
        name = None
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                b.step()
        except ValueError:  # it raises on the first module with inf/nan, after printing its
            # frames: the last frame header ("<17 spaces> <module name> <Class>") is the module
            headers = re.findall(r"^ {17} (\S*) (\w+)$", printed.getvalue(), re.MULTILINE)
            name = headers[-1][0] if headers else "?"
        except Exception as err:  # noqa: BLE001 - the peer itself fails on some models
            return f"crashed ({type(err).__name__})", False, tool
    else:
        tool = "forward-hook equivalent (benchmarks/pinpoint.py)"
        dbg = ForwardHookDebugger(b.model)
        try:
            b.step()
        finally:
            dbg.close()
        name = dbg.first
    if name is None:
        return "-", False, tool
    e = mod.EXPECTED
    return f"forward {name or '(root)'}", e["phase"] == "forward" and name == e["module"], tool


def replay_ratio(mod: Any, repeats: int = 15) -> float:
    b = mod.build()
    opts = b.notes.get("optimizers", b.optimizer)
    snap = StepSnapshot.capture(b.model, b.optimizer)
    plain, replay = [], []
    for i in range(repeats + 2):
        snap.restore()
        t = time.perf_counter()
        b.step()
        dt = time.perf_counter() - t
        t = time.perf_counter()
        if opts is b.optimizer:
            replay_step(b.step, model=b.model, optimizer=b.optimizer, snapshot=snap,
                        batch=b.batch)
        else:  # several optimizers (GAN): restore, then run checked
            snap.restore()
            find_origin(b.step, model=b.model, optimizer=opts, batch=b.batch)
        if i >= 2:
            plain.append(dt)
            replay.append(time.perf_counter() - t)
    return statistics.median(replay) / statistics.median(plain)


def main() -> None:
    torch.set_num_threads(1)
    rows, hits = [], {"nanguard": 0, "detect_anomaly": 0, "forward_hooks": 0}
    ratios: dict[str, float] = {}
    tool = ""
    for name in SCENARIOS:
        mod = load(name)
        if mod.build().skip:
            rows.append((name, "skipped", "", "", "", ""))
            continue
        e = mod.EXPECTED
        ng, ok1 = nanguard_names(mod)
        an, ok2 = anomaly_names(mod)
        fh, ok3, tool = hooks_names(mod)
        ratios[name] = replay_ratio(mod)
        hits["nanguard"] += ok1
        hits["detect_anomaly"] += ok2
        hits["forward_hooks"] += ok3
        mark = {True: "ok", False: "x"}
        rows.append((name, f"{e['phase']} {e['module']} {e['op']}", f"{mark[ok1]} {ng}",
                     f"{mark[ok2]} {an}", f"{mark[ok3]} {fh}", f"{ratios[name]:.1f}x"))
    head = ("scenario", "expected (phase module op)", "nanguard", "detect_anomaly",
            "forward hooks", "replay/step")
    widths = [max(len(str(r[i])) for r in [*rows, head]) for i in range(len(head))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
    print(line)
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) + " |")
    n = sum(1 for r in rows if r[1] != "skipped")
    print(f"forward hooks tool: {tool}; scenarios run: {n}; torch {torch.__version__}")
    print(json.dumps({"scenarios": n, "hits": hits,
                      "max_replay_ratio": round(max(ratios.values()), 2),
                      "median_replay_ratio": round(statistics.median(ratios.values()), 2)}))


if __name__ == "__main__":
    main()
