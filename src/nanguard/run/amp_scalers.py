"""The GradScalers of a script run by `nanguard run`, found without the script's help.

A mixed-precision loop (`scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`)
needs three things from its `torch.amp.GradScaler` that the guard API gets as `scaler=`:

* the scaler itself, so that a step it skips for inf/NaN gradients is counted (`amp_skip`),
  never an alarm, and its scale is recorded and watched for a collapse;
* the loss in the script's units: the tensor backpropagated is `scaler.scale(loss)`, the loss
  times the scale, whatever the loss was (also one the in-process recorder does not know, such
  as a loss of `model(x).float()`);
* the iterations whose optimizer step the scaler skipped: no step hook runs in them, so their
  loss and batch must be handed to the guard at `scaler.update()` (as a guard's own users
  call `watch()` every iteration), never carried into the next step as a micro-batch.

`ScalerTracker` patches `GradScaler.__init__`, `.scale` and `.update` (subclasses such as
`torch.cuda.amp.GradScaler` included) while installed and calls `on_update` before each
`update()`. It keeps weak references only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.amp import grad_scaler

__all__ = ["ScalerTracker", "served"]


class ScalerTracker:
    """Find the script's GradScalers and what each scaled.

    Args:
        on_update: called with a scaler right before its `update()` runs (the end of an
            iteration); may raise nothing (the caller's own fail-open wrapper).
        active: whether to do anything now (False in a forked worker, in a quiet phase).
    """

    def __init__(self, on_update: Callable[[Any], None], active: Callable[[], bool]) -> None:
        self.on_update = on_update
        self.active = active
        self._scalers: list[weakref.ref[Any]] = []
        self._scaled: tuple[weakref.ref[torch.Tensor], torch.Tensor] | None = None
        self._saved: tuple[Any, Any, Any] | None = None

    def install(self) -> ScalerTracker:
        cls = grad_scaler.GradScaler
        init, scale, update = cls.__init__, cls.scale, cls.update
        self._saved = (init, scale, update)
        me = weakref.ref(self)

        def tracked_init(scaler: Any, *args: Any, **kwargs: Any) -> None:
            init(scaler, *args, **kwargs)
            t = me()
            if t is not None and t.active():
                t._scalers.append(weakref.ref(scaler))

        def tracked_scale(scaler: Any, outputs: Any) -> Any:
            out = scale(scaler, outputs)
            t = me()
            if (t is not None and t.active() and isinstance(outputs, torch.Tensor)
                    and isinstance(out, torch.Tensor) and out is not outputs):
                t._scaled = (weakref.ref(out), outputs.detach())
            return out

        def tracked_update(scaler: Any, *args: Any, **kwargs: Any) -> Any:
            t = me()
            if t is not None and t.active():
                t.on_update(scaler)
            return update(scaler, *args, **kwargs)

        cls.__init__ = tracked_init  # type: ignore[method-assign,assignment]
        cls.scale = tracked_scale  # type: ignore[method-assign,assignment]
        cls.update = tracked_update  # type: ignore[method-assign,assignment]
        return self

    def remove(self) -> None:
        """Restore GradScaler (idempotent)."""
        if self._saved is None:
            return
        cls = grad_scaler.GradScaler
        cls.__init__, cls.scale, cls.update = self._saved  # type: ignore[method-assign]
        self._saved = None
        self._scaled = None

    def unscaled(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The loss (detached) that `tensor` is `scaler.scale(...)` of, else None."""
        if self._scaled is not None and self._scaled[0]() is tensor:
            return self._scaled[1]
        return None

    def scaler_for(self, optimizer: torch.optim.Optimizer) -> Any:
        """The enabled scaler stepping `optimizer` now (it has unscaled its gradients in
        this iteration), else the last enabled one made, else None."""
        live = [s for s in (r() for r in self._scalers)
                if s is not None and s.is_enabled()]
        for s in reversed(live):
            if id(optimizer) in served(s):
                return s
        return live[-1] if live else None


def served(scaler: Any) -> set[int]:
    """Ids of the optimizers `scaler` has handled in this iteration (`unscale_`/`step`): torch
    keeps their state until `update()`."""
    return set(getattr(scaler, "_per_optimizer_states", {}) or {})
