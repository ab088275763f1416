"""Per-module activation abs-max, for headroom to the dtype's largest value.

Forward hooks on leaf modules keep a running abs-max on the device (no host read in the hook);
the guard collects them once per step. Hooks are removable: `close()` removes every handle.
On the same sampled steps, the largest |attention logit| (`watch.attention`), where the model
has attention.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from nanguard.runtime.hooks import ModuleHook
from nanguard.watch.attention import AttentionProbe


def dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of a floating dtype (float32 for anything else)."""
    if not dtype.is_floating_point:
        dtype = torch.float32
    return float(torch.finfo(dtype).max)


class ActivationProbe:
    """Watches the outputs of every leaf module of `model`.

    Args:
        model: the module to watch.
        attention: also measure the largest |attention logit| on the same steps
            (`AttentionProbe`).
    """

    def __init__(self, model: nn.Module, attention: bool = True) -> None:
        self.attention = AttentionProbe(model) if attention else None
        self.names: list[str] = []
        self.dtypes: dict[str, torch.dtype] = {}
        self._current: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        """This step's (min, max) of each module's output, on the device."""
        self._seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], weakref.ref[Any]] = {}
        self._handles: list[RemovableHandle] = []
        self._enabled = False
        self.enabled = True
        for name, module in model.named_modules():
            if next(module.children(), None) is None and name:
                self.names.append(name)
                self._handles.append(module.register_forward_hook(ModuleHook(self._hook(name))))

    @property
    def enabled(self) -> bool:
        """Whether this step's forwards are measured (set in the step post-hook for the next
        step: the sampled steps; off during a replay)."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        self._enabled = on
        if self.attention is not None:
            self.attention.enabled = on

    def _hook(self, name: str) -> Callable[[nn.Module, object, object], None]:
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            # Forwards without autograd (validation, inference) are not training steps.
            if not self._enabled or not torch.is_grad_enabled():
                return
            if isinstance(output, (tuple, list)):
                output = next((o for o in output if isinstance(o, torch.Tensor)), None)
            if not isinstance(output, torch.Tensor) or not output.is_floating_point():
                return
            if output.numel() == 0:
                return
            # A module that hands on a tensor already measured (identity, dropout p=0, a view)
            # adds nothing: skip the second pass over the same memory.
            # (A weak reference, so that memory freed and reused by another tensor counts anew.)
            key = (output.data_ptr(), tuple(output.shape), tuple(output.stride()))
            seen = self._seen.get(key)
            if seen is not None and seen() is not None:
                return
            self._seen[key] = weakref.ref(output)
            with torch.no_grad():
                # aminmax reads the tensor once without the full-size copy that abs() makes;
                # a NaN propagates into both. The abs-max, max(hi, -lo), is taken for every
                # module at once in `collect` (a neg and a maximum a step, not per module).
                # Kept in the output's dtype: `collect` learns the dtype from it, so the hook
                # writes no Python state that torch.compile would guard on (a recompile).
                lo, hi = torch.aminmax(output.detach())
                prev = self._current.get(name)
                if prev is not None:  # called several times in one step: its widest range
                    lo, hi = torch.minimum(prev[0], lo), torch.maximum(prev[1], hi)
            self._current[name] = (lo, hi)

        return hook

    def collect(self) -> tuple[list[str], torch.Tensor | None]:
        """Take this step's abs-max values (device tensor) and reset for the next step."""
        self._seen.clear()
        if not self._current:
            return [], None
        names = list(self._current)
        for n in names:
            self.dtypes[n] = self._current[n][1].dtype
        # Stacks promote mixed dtypes (float16 and float32 under autocast) exactly.
        his = torch.stack([self._current[n][1] for n in names])
        los = torch.stack([self._current[n][0] for n in names])
        self._current = {}
        return names, torch.maximum(his, torch.neg(los))

    def attention_max(self) -> torch.Tensor | None:
        """This step's largest |attention logit| (device value; None: no attention seen or
        not watched); resets for the next step."""
        return self.attention.collect() if self.attention is not None else None

    def close(self) -> None:
        if self.attention is not None:
            self.attention.close()
        for h in self._handles:
            h.remove()
        self._handles.clear()
