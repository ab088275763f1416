"""Independent NaN tracer for the program suite: plain PyTorch, no nanguard.

The training scripts next to this file import it only when the environment variable
`NANTRACE=1` is set. It checks, at each update step of the script, in this order: state that
was already non-finite before the first step (a loaded checkpoint), the batch (rows holding
NaN/Inf), module outputs of grad-enabled forwards, the loss, the gradients, and the parameters
and optimizer state after the update. The first non-finite value it meets is printed once to
stderr as `NANTRACE {"step": K, "phase": P, ...}` where K is the 0-based index of the update
step (updates completed before it); at exit `NANTRACE_END {"steps": N}` gives the number of
update steps (a forward that held a non-finite value and never reached its loss, because the
script raised there, is printed at exit). The tests compare nanguard's report against these lines.
"""

from __future__ import annotations

import atexit
import json
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

PREFIX = "NANTRACE "
END = "NANTRACE_END "


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _finite(obj: Any) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in _tensors(obj)
               if t.is_floating_point() or t.is_complex())


class Tracer:
    """Watches `models` (forward outputs, parameters) and `optimizers` (state).

    Call `start(batch)` before the forward of a step, `loss(l)` once the loss is computed,
    `grads()` after backward, `updated()` after the update (it advances the step count).
    """

    def __init__(self, models: Iterable[nn.Module], optimizers: Iterable[Any] = ()) -> None:
        self.models = list(models)
        self.optimizers = list(optimizers)
        self.step = 0
        self.done = False
        self.forward_bad: str | None = None
        self.loss_seen = False
        self.grads_seen = False
        for m in self.models:
            for name, mod in m.named_modules():
                mod.register_forward_hook(self._hook(name))
        atexit.register(self._end)

    def _end(self) -> None:
        if self.forward_bad is not None:
            # The script ended inside a step whose forward held a non-finite value and never
            # reached its loss (it raised in the forward: the program's own check, or an
            # error that followed the value).
            self.emit("forward", module=self.forward_bad)
        print(END + json.dumps({"steps": self.step}), file=sys.stderr, flush=True)

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, inputs: Any, output: Any) -> None:
            if torch.is_grad_enabled() and self.forward_bad is None and not _finite(output):
                self.forward_bad = name or type(mod).__name__
        return hook

    def emit(self, phase: str, **extra: Any) -> None:
        if not self.done:
            self.done = True
            line = json.dumps({"step": self.step, "phase": phase, **extra})
            print(PREFIX + line, file=sys.stderr, flush=True)

    def _state_bad(self) -> list[str]:
        bad = [f"param:{n}" for m in self.models for n, p in m.named_parameters()
               if not _finite(p.detach())]
        for k, opt in enumerate(self.optimizers):
            for st in opt.state.values():
                if not _finite(st):
                    bad.append(f"optimizer{k}:{[n for n, v in st.items() if not _finite(v)]}")
        return bad

    def start(self, batch: Any = None) -> None:
        self.forward_bad = None
        self.loss_seen = False
        self.grads_seen = False
        if self.step == 0:
            bad = self._state_bad()
            if bad:
                self.emit("checkpoint", what=bad)
        if isinstance(batch, torch.Tensor) and batch.is_floating_point():
            rows = (~torch.isfinite(batch.reshape(len(batch), -1))).any(1)
            if bool(rows.any()):
                self.emit("data", samples=rows.nonzero().flatten().tolist())

    def loss(self, value: torch.Tensor) -> None:
        if self.loss_seen:  # a later closure evaluation inside the same step (LBFGS)
            return
        self.loss_seen = True
        if self.forward_bad is not None:
            self.emit("forward", module=self.forward_bad)
        if not _finite(value.detach()):
            self.emit("loss")

    def grads(self) -> None:
        if self.grads_seen:
            return
        self.grads_seen = True
        if not all(_finite(p.grad) for m in self.models for p in m.parameters()
                   if p.grad is not None):
            self.emit("backward")

    def updated(self) -> None:
        bad = self._state_bad()
        if bad:
            self.emit("optimizer", what=bad)
        self.step += 1
