"""Largest |attention logit| of a training step, on the steps activations are sampled.

Attention logit growth (softmax inputs of ever larger magnitude, until the attention is one-hot
and its gradient vanishes or, in half precision, overflows) is one of the things large runs
watch before a loss spike. It lives inside a fused kernel (`F.scaled_dot_product_attention`)
or between a matmul and a softmax in the model's own code, where no module hook sees it.

`AttentionProbe` arms a `TorchFunctionMode` for the model's forward on sampled steps only (its
forward pre-hook enters the mode, its forward hook leaves it, even when the forward raises),
so a non-sampled step has no hook and no mode at all. While armed, the mode sees:

- `F.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, scale, enable_gqa)`: it
  recomputes the logits `q @ k^T * scale` (+ a float mask), in float32 and in blocks of query
  rows (at most `BLOCK` entries at a time: the fused kernel never materialised them all);
- `softmax` (`F.softmax`, `torch.softmax`, `Tensor.softmax`) over the last dimension of a
  4-d tensor (batch, heads, queries, keys): nanoGPT's and transformers' "eager" attention
  (`att = q @ k^T * scale; att.masked_fill(mask, -inf); softmax(att, -1)`). A 2-d or 3-d
  softmax (a classifier's, an LM head's) is not attention-shaped and is left alone.

Masked entries do not count: those a boolean mask or `is_causal` excludes, and entries at or
below `MASKED` (-1e3): the fill values and additive masks models use (-inf, finfo.min, -1e9,
BERT's -1e4). A NaN or +inf logit counts (its max is NaN / inf). The result, the running max
over every attention call of the forward (several forwards per step: gradient accumulation),
stays on the device until the step's packet is read (`collect`); no host read here.

Observing never changes training: the mode calls every function as it was called and only
reads its inputs, under `torch.no_grad()`. An error of the probe's own turns it off for good
(a monitor never breaks training). Forwards without autograd (validation) and forwards being
compiled (`torch.compile` traces the hooks) are not measured.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from nanguard.runtime.hooks import ModuleHook
from nanguard.watch.modes import leave

MASKED = -1e3
"""A softmax input at or below this is a masked entry (a fill value or an additive mask)."""
BLOCK = 1 << 24
"""Logits recomputed at once for one scaled_dot_product_attention call at most (64 MiB of
float32): more query rows are taken block by block. Bounds the transient memory; the number of
blocks (a few ops each) is what a long context pays on a sampled step (batch x heads 256 at
4096 tokens: 256 blocks per call)."""

_SDPA = F.scaled_dot_product_attention
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}


def sdpa_logits_absmax(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None = None,
                       is_causal: bool = False, scale: float | None = None,
                       enable_gqa: bool = False) -> torch.Tensor:
    """Largest |q @ k^T * scale (+ float mask)| over the entries attention uses, as
    `F.scaled_dot_product_attention` defines them (0-dim float32 tensor on q's device)."""
    q, k = q.detach().float(), k.detach().float()
    if enable_gqa and q.dim() >= 3 and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kt = k.transpose(-2, -1)
    lead = max(1, q[..., 0, 0].numel(), k[..., 0, 0].numel())
    rows = max(1, BLOCK // max(1, lead * n_k))
    out: torch.Tensor | None = None
    # In place, few ops: on a small model each op's dispatch is what the sampled step pays.
    for r0 in range(0, n_q, rows):
        r1 = min(n_q, r0 + rows)
        s = (q[..., r0:r1, :] @ kt).mul_(scale)
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            s = _unmasked_abs(s + _rows(attn_mask, r0, r1, n_q).float())  # (may broadcast s)
        else:
            s = s.abs_()
        if is_causal:
            s = s.tril_(r0)  # row r0 + i sees keys 0..r0 + i; the rest is masked: 0
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            s = torch.where(_rows(attn_mask, r0, r1, n_q), s, 0.0)
        top = s.amax()
        out = top if out is None else torch.maximum(out, top)
    return out if out is not None else torch.zeros((), device=q.device)


def _rows(mask: torch.Tensor, r0: int, r1: int, n_q: int) -> torch.Tensor:
    """The mask's rows r0..r1 (a mask broadcast over the query rows as it is)."""
    return mask[..., r0:r1, :] if mask.dim() >= 2 and mask.shape[-2] == n_q else mask


def _unmasked_abs(s: torch.Tensor) -> torch.Tensor:
    """|s| with masked entries (<= MASKED, -inf included) set to 0; NaN kept."""
    return torch.where(s <= MASKED, 0.0, s.abs())


class _Mode(TorchFunctionMode):
    """Sees attention calls of one armed forward (see the module docstring)."""

    def __init__(self, probe: AttentionProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _SDPA or func in _SOFTMAX:
            try:
                with torch.no_grad():
                    self.probe.see(func, args, kwargs)
            except Exception:  # noqa: BLE001 - a monitor never breaks training
                self.probe.broken = True
        return out


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


class _WarningsAtCaller:
    """While a forward is armed, a warning raised inside a function the mode passed on (a
    deprecation in `F.dropout2d`, say) points at the mode's frame: its `stacklevel` counts the
    mode as the caller. Installed as `warnings.showwarning` for the armed forward only, this
    re-issues such a warning at the user's line, under that module's filters and registry, as
    it would have gone without the mode: shown once, from the user's code, not a second time
    from nanguard's. Every other warning passes through untouched."""

    def __init__(self) -> None:
        self.saved: Any = None

    def install(self) -> None:
        if self.saved is None:
            self.saved = warnings.showwarning
            warnings.showwarning = self.show

    def uninstall(self) -> None:
        saved, self.saved = self.saved, None
        if saved is not None and warnings.showwarning == self.show:
            warnings.showwarning = saved  # (someone else's replacement since is left alone)

    def show(self, message: Any, category: Any, filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        saved = self.saved or warnings.showwarning
        frame = _caller_of_mode() if filename == __file__ else None
        if frame is None:
            saved(message, category, filename, lineno, file, line)
            return
        g = frame.f_globals
        warnings.showwarning = saved
        try:
            warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                                   module=g.get("__name__"),
                                   registry=g.setdefault("__warningregistry__", {}),
                                   module_globals=g)
        finally:
            warnings.showwarning = self.show


def _caller_of_mode() -> FrameType | None:
    """The first frame outside torch above the mode's `__torch_function__` (the user's call
    of the function that warned), or None when the mode is not on the stack."""
    code = _Mode.__torch_function__.__code__
    f: FrameType | None = sys._getframe(1)
    while f is not None and f.f_code is not code:
        f = f.f_back
    if f is None:
        return None
    f = f.f_back
    while f is not None and f.f_code.co_filename.startswith(_TORCH_DIR):
        f = f.f_back
    return f


class AttentionProbe:
    """Measures the largest |attention logit| of `model`'s forward on enabled steps.

    Args:
        model: the module whose forward is watched (its own forward hooks arm the mode).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.broken = False
        self.armed_forwards = 0
        """Forwards measured so far (tests and the curious)."""
        self._max: torch.Tensor | None = None
        self._mode: _Mode | None = None
        self._depth = 0
        self._handles: list[RemovableHandle] = []
        self._enabled = False
        self._warnings = _WarningsAtCaller()

    @property
    def enabled(self) -> bool:
        """Whether the next forwards are measured. Enabling registers the two forward hooks,
        disabling removes them: a step that is not sampled runs no code of the probe's."""
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        on = on and not self.broken
        if on == self._enabled:
            return
        self._enabled = on
        if on:
            self._handles = [
                self.model.register_forward_pre_hook(ModuleHook(self._enter)),
                self.model.register_forward_hook(ModuleHook(self._leave), always_call=True)]
        else:
            for h in self._handles:
                h.remove()
            self._handles = []
            self._exit_mode()

    def _enter(self, *_: Any) -> None:
        if not self._enabled:
            # Disabled by an earlier pre-hook of this same forward (a hand-written update's
            # step boundary is found there): torch still calls the hooks it listed when the
            # forward began, but `_leave` is gone, so a mode entered now would never be left.
            return
        self._depth += 1
        if (self._depth > 1 or self._mode is not None or self.broken
                or not torch.is_grad_enabled() or torch.compiler.is_compiling()):
            return
        mode = _Mode(self)
        mode.__enter__()
        self._mode = mode
        self._warnings.install()
        self.armed_forwards += 1

    def _leave(self, *_: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self._exit_mode()

    def _exit_mode(self) -> None:
        """Leave the mode (idempotent). Leaving out of order (a mode entered inside the
        forward and still active) raises in torch: the probe then turns itself off."""
        mode, self._mode = self._mode, None
        self._warnings.uninstall()
        if mode is not None and not leave(mode):
            self.broken = True
            self.enabled = False

    def see(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """One attention call's logits into the step's running max (device values only)."""
        if func is _SDPA:
            # (enable_gqa is keyword-only; the tensors may come by name too.)
            arg = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                            "scale"), args, strict=False))
            arg.update(kwargs)
            q, k = arg.get("query"), arg.get("key")
            if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                    and q.is_floating_point()):
                return
            m = sdpa_logits_absmax(q, k, arg.get("attn_mask"), bool(arg.get("is_causal")),
                                   arg.get("scale"), bool(arg.get("enable_gqa")))
        else:
            x = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if (not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point()
                    or dim not in (-1, 3)):
                return
            m = _unmasked_abs(x.detach().float()).amax()
        self._max = m if self._max is None else torch.maximum(self._max, m)

    def collect(self) -> torch.Tensor | None:
        """This step's largest |attention logit| (0-dim device tensor), None when no
        attention call was seen or the probe broke (a max over some calls only would claim
        too little); resets for the next step."""
        m, self._max = self._max, None
        return None if self.broken else m

    def close(self) -> None:
        """Remove the hooks (the guard closed)."""
        self.enabled = False
