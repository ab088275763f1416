"""The last good state, in host memory: one copy of parameters, buffers and optimizer state.

Buffers are allocated once (pinned when the model lives on a GPU, so the device-to-host copy is
asynchronous) and refreshed in place; a snapshot never holds more than one extra copy of the
model and optimizer state. Small state (step counters, the optimizer's param-group
hyperparameters, LR scheduler, GradScaler, RNG) is kept by value.

When: the guard captures in its post-hook (inside `optimizer.step()` of step n-1, before the
user's `scheduler.step()` / `scaler.update()`) and restores inside the failing step's
`optimizer.step()`, before that step's `scheduler.step()`. The scheduler state kept is the one
from before the `scheduler.step()` that leads into step n, and the user's next call brings it
there. A capture made between steps (the initial one, `in_step=False`) already holds the state
of step n itself, and no step -1 exists to go back to: after restoring it, `reapply` puts the
param-group hyperparameters, scheduler and scaler back once more at the next update, after the
user's `scheduler.step()` has moved them on.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from nanguard.watch import rng


class HostSnapshot:
    """Copies of `model` and `optimizer` state (plus optional scheduler / scaler) on the host.

    Args:
        model: the trained model (parameters and buffers are kept).
        optimizer: its optimizer (tensor state kept in host buffers, the rest by value).
        extras: objects with `state_dict` / `load_state_dict` (LR scheduler, GradScaler).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        extras: dict[str, Any] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extras = {k: v for k, v in (extras or {}).items() if v is not None}
        self.step: int | None = None
        self.in_step = True
        self._tensors: list[torch.Tensor] = []  # live tensors, in a fixed order
        self._host: list[torch.Tensor] = []
        self._opt_meta: dict[int, dict[str, Any]] = {}  # per param: non-tensor state by value
        self._opt_keys: dict[int, list[str]] = {}  # per param: tensor state keys, in order
        self._groups: list[dict[str, Any]] = []  # param-group hyperparameters (lr, ...)
        self._extras_state: dict[str, Any] = {}
        self._rng: dict[str, Any] | None = None

    def _model_tensors(self) -> list[torch.Tensor]:
        """Parameters of the model AND of the optimizer (one trained outside the model, e.g. a
        temperature, must roll back with its momentum), then the model's buffers."""
        params = list(self.model.parameters())
        seen = {id(p) for p in params}
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return [p.detach() for p in params] + list(self.model.buffers())

    def _live(self) -> tuple[list[torch.Tensor], dict[int, list[str]], dict[int, dict[str, Any]]]:
        tensors = self._model_tensors()
        keys: dict[int, list[str]] = {}
        meta: dict[int, dict[str, Any]] = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            state = self.optimizer.state.get(p)
            if not state:
                continue
            keys[i] = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            meta[i] = {
                k: copy.deepcopy(v) for k, v in state.items() if not isinstance(v, torch.Tensor)
            }
            tensors += [state[k] for k in keys[i]]
        return tensors, keys, meta

    def capture(self, step: int, *, in_step: bool = True) -> None:
        """Copy the current state into the host buffers (the state at the start of `step`).

        `in_step`: called from inside `optimizer.step()` of step `step - 1` (the guard's
        post-hook), before the user's `scheduler.step()`; False for a capture between steps (see
        the module docstring).
        """
        tensors, keys, meta = self._live()
        shapes = [(t.shape, t.dtype) for t in tensors]
        if shapes != [(h.shape, h.dtype) for h in self._host]:
            # First capture, or the optimizer state appeared / changed layout: allocate again.
            pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
            self._host = []  # free the old buffers first: never two copies at once
            self._host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for t in tensors
            ]
        with torch.no_grad():
            for h, t in zip(self._host, tensors, strict=True):
                h.copy_(t, non_blocking=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()  # the copies must land before training
        self._opt_keys, self._opt_meta = keys, meta
        self._groups = [
            {k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
        ]
        self._extras_state = {k: copy.deepcopy(v.state_dict()) for k, v in self.extras.items()}
        self.in_step = in_step
        self._rng = rng.capture()
        self.step = step

    def restore(self) -> int:
        """Put the captured state back in place (same tensor objects); return its step."""
        assert self.step is not None and self._rng is not None, "restore() before capture()"
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        model_tensors = self._model_tensors()
        n = len(model_tensors)
        with torch.no_grad():
            for live, h in zip(model_tensors, self._host[:n], strict=True):
                live.copy_(h, non_blocking=True)
        pos = n
        kept = set(self._opt_keys)
        for i, p in enumerate(params):
            if i not in kept:
                # No state at capture time (e.g. before the first step): none now either.
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state.setdefault(p, {})
            for k in self._opt_keys[i]:
                h = self._host[pos]
                pos += 1
                cur = state.get(k)
                if isinstance(cur, torch.Tensor) and cur.shape == h.shape:
                    with torch.no_grad():
                        cur.copy_(h, non_blocking=True)
                else:
                    device = "cpu" if k == "step" and h.dim() == 0 else p.device
                    state[k] = h.to(device, copy=True)
            state.update(copy.deepcopy(self._opt_meta[i]))
        self.reapply()
        rng.restore(self._rng)
        return self.step

    def reapply(self) -> None:
        """Put the param-group hyperparameters (lr & co: chainable schedulers build on them),
        the scheduler and the scaler back as captured."""
        for g, saved in zip(self.optimizer.param_groups, self._groups, strict=True):
            g.update(copy.deepcopy(saved))
        for k, obj in self.extras.items():
            obj.load_state_dict(copy.deepcopy(self._extras_state[k]))

    @property
    def nbytes(self) -> int:
        """Host memory held by the snapshot's tensor buffers."""
        return sum(h.numel() * h.element_size() for h in self._host)
