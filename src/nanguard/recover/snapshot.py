"""The last good state, in host memory: exactly what the optimizer trains, one copy.

What is kept: the parameters the optimizer trains (those in its param groups that require a
gradient or hold one: a frozen parameter, e.g. the base weights under a LoRA adapter, is never
changed by the optimizer and is not copied), their optimizer state, the model's buffers
(BatchNorm running statistics), the optimizer's param-group hyperparameters, the LR scheduler,
the GradScaler and the RNG. Parameters of the same model trained by another optimizer are that
optimizer's business: restoring them without their optimizer state would leave that optimizer
inconsistent (its guard restores them, see `nanguard.recover.recovery`).

Buffers are allocated once (pinned when the model lives on a GPU, so the device-to-host copy is
asynchronous) and refreshed in place; a snapshot never holds more than one extra copy of the
trained state. Small state (step counters, the optimizer's param-group hyperparameters, LR
scheduler, GradScaler, RNG) is kept by value. The tensors are restored into the objects they were
copied from (by reference, kept at capture time): a parameter group added after the capture, or
a parameter unfrozen after it, is left as it is.

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


def trained_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters `optimizer` can change: in its param groups (each once), requiring a
    gradient or holding one (optimizers skip a parameter whose `.grad` is None)."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in seen and (p.requires_grad or p.grad is not None):
                seen.add(id(p))
                out.append(p)
    return out


class HostSnapshot:
    """Host copies of what `optimizer` trains, its state, `model`'s buffers and the extras.

    Args:
        model: the trained model (its buffers are kept; its parameters only where `optimizer`
            trains them).
        optimizer: its optimizer (parameters it trains and their tensor state in host buffers,
            the rest by value).
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
        self._params: list[torch.Tensor] = []  # the trained parameters at capture time
        self._buffers: list[torch.Tensor] = []  # the model's buffers at capture time
        self._host: list[torch.Tensor] = []
        self._layout: list[tuple[torch.Size, torch.dtype, torch.layout]] = []
        self._opt_meta: dict[int, dict[str, Any]] = {}  # per param: non-tensor state by value
        self._opt_keys: dict[int, list[str]] = {}  # per param: tensor state keys, in order
        self._groups: list[dict[str, Any]] = []  # param-group hyperparameters (lr, ...)
        self._extras_state: dict[str, Any] = {}
        self._rng: dict[str, Any] | None = None

    def _live(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor],
                             dict[int, list[str]], dict[int, dict[str, Any]]]:
        """(trained params, buffers, every tensor to copy in order, state keys, state meta)."""
        params = trained_params(self.optimizer)
        buffers = list(self.model.buffers())
        tensors = [p.detach() for p in params] + buffers
        keys: dict[int, list[str]] = {}
        meta: dict[int, dict[str, Any]] = {}
        for i, p in enumerate(params):
            state = self.optimizer.state.get(p)
            if not state:
                continue
            keys[i] = [k for k, v in state.items() if isinstance(v, torch.Tensor)]
            meta[i] = {
                k: copy.deepcopy(v) for k, v in state.items() if not isinstance(v, torch.Tensor)
            }
            tensors += [state[k] for k in keys[i]]
        return params, buffers, tensors, keys, meta

    def capture(self, step: int, *, in_step: bool = True) -> None:
        """Copy the current state into the host buffers (the state at the start of `step`).

        `in_step`: called from inside `optimizer.step()` of step `step - 1` (the guard's
        post-hook), before the user's `scheduler.step()`; False for a capture between steps (see
        the module docstring).
        """
        params, buffers, tensors, keys, meta = self._live()
        layout = [(t.shape, t.dtype, t.layout) for t in tensors]
        if layout != self._layout:
            # First capture, or the optimizer state appeared / changed layout: allocate again.
            pin = any(t.is_cuda for t in tensors) and torch.cuda.is_available()
            self._host = []  # free the old buffers first: never two copies at once
            self._host = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                if t.layout == torch.strided else torch.empty(0)
                for t in tensors
            ]
            self._layout = layout
        with torch.no_grad():
            for i, t in enumerate(tensors):
                if t.layout == torch.strided:
                    self._host[i].copy_(t, non_blocking=True)
                else:
                    # Sparse state (SGD momentum of a sparse gradient): its size changes from
                    # step to step, so it is copied whole, not into a buffer.
                    self._host[i] = t.detach().to("cpu", copy=True)
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()  # the copies must land before training
        self._params, self._buffers = params, buffers
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
        live = [p.detach() for p in self._params] + self._buffers
        n = len(live)
        with torch.no_grad():
            for t, h in zip(live, self._host[:n], strict=True):
                t.copy_(h, non_blocking=True)  # converts if the model changed dtype since
        pos = n
        for i, p in enumerate(self._params):
            if i not in self._opt_keys:
                # No state at capture time (e.g. before the first step): none now either.
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state.setdefault(p, {})
            for k in self._opt_keys[i]:
                h = self._host[pos]
                pos += 1
                cur = state.get(k)
                if (isinstance(cur, torch.Tensor) and cur.shape == h.shape
                        and cur.layout == h.layout == torch.strided):
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
        the scheduler and the scaler back as captured. Groups added since are left alone."""
        for g, saved in zip(self.optimizer.param_groups, self._groups, strict=False):
            g.update(copy.deepcopy(saved))
        for k, obj in self.extras.items():
            obj.load_state_dict(copy.deepcopy(self._extras_state[k]))

    @property
    def nbytes(self) -> int:
        """Host memory held by the snapshot's tensor buffers."""
        return sum(_nbytes(h) for h in self._host)


def _nbytes(t: torch.Tensor) -> int:
    if t.layout == torch.sparse_coo:
        return (t._values().numel() * t._values().element_size()
                + t._indices().numel() * t._indices().element_size())
    if t.layout != torch.strided:
        return 0  # other sparse layouts: not kept by any torch.optim optimizer
    return t.numel() * t.element_size()
