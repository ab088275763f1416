"""Saturation precursor: a sigmoid / softmax probability about to round to exactly 0 or 1 in its
dtype, feeding a `log`.

The textbook logistic regression on raw tensors, `h = torch.sigmoid(X @ W + b)`,
`cost = -(Y * torch.log(h) + (1 - Y) * torch.log(1 - h)).mean()`, trains for thousands of steps
with a smoothly falling loss while its logits keep growing; the first step where one `h`
rounds to exactly 1.0 (float32: logit above ~17) makes `log(1 - h)` -inf and the loss NaN, with
no magnitude anywhere near overflow to warn of it. What does warn: the probabilities that the
`log` consumes creep to within a few units in the last place of 0 or 1 first.

`SaturationProbe` arms a `TorchDispatchMode` for one step every `DetectConfig.saturation_every`
steps (armed in the guard's step post-hook, so it sees the next step's forward; disarmed in
the next step pre-hook). While armed it marks the outputs of `sigmoid` / `softmax`, follows them
through `1 - p` and view/copy ops, and when a `log` consumes one it checks the side that the log
makes dangerous: `log(p)` needs `p` away from 0 (below the dtype's smallest normal number, the
next roundings reach 0), `log(1 - p)` needs `p` away from 1 (within `NEAR_ULPS` units in the last
place of 1.0). A hit raises a `saturation` alarm (a warning: recorded, never acted on), said
again only when it gets far worse (exact 0/1 entries, or 10x as many). `log(softmax(x))` written
by hand is the `log(p)` side. `F.binary_cross_entropy` fed a sigmoid output never NaNs (it
clamps its logs at -100) but kills the gradient where `p` rounds to 0 or 1: entries saturated
on the wrong side of their target are warned of too (`SaturationProbe.check_bce`). Unarmed
steps cost nothing; an armed step runs every op through Python (about one extra step's time per
`saturation_every` steps). An error of the probe's own disarms it for good: a monitor never
breaks training.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
import weakref
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.hooks import RemovableHandle

from nanguard.detect.alarm import Alarm
from nanguard.watch.modes import leave


class Host(Protocol):
    """What the probe uses of the guard it serves (the Guard is one; this module never imports
    it)."""

    optimizer: torch.optim.Optimizer
    error: dict[str, Any] | None

    @property
    def step(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    def record_alarm(self, alarm: Alarm) -> None: ...


NEAR_ULPS = 16
"""`1 - p` at most this many ulps of 1.0 (float32: 2**-20) is a probability about to round to 1."""

# Frames in torch or in nanguard itself are not the user's line (nanguard: this file's package).
_SKIP_DIRS = (os.path.dirname(torch.__file__ or "") + os.sep,
              os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
_aten = torch.ops.aten
_SOURCES = {_aten.sigmoid.default: "sigmoid", _aten._softmax.default: "softmax",
            _aten.softmax.int: "softmax"}
_LOGS = {_aten.log.default, _aten.log2.default, _aten.log10.default}
# Ops whose output is the same values as their first input (a view, a copy, a reshape).
_SAME = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default,
         _aten.clone.default, _aten._to_copy.default, _aten.detach.default,
         _aten.expand.default, _aten.t.default, _aten.transpose.int, _aten.squeeze.dim,
         _aten.unsqueeze.default, _aten.slice.Tensor, _aten.select.int, _aten.contiguous.default,
         _aten.alias.default}


class _Mode(TorchDispatchMode):
    """Marks probabilities and checks what a `log` receives (see the module docstring)."""

    def __init__(self, probe: SaturationProbe) -> None:
        super().__init__()
        self.probe = probe
        # id(tensor) -> (weakref to it, the probability it derives from, its side, source op)
        self.marks: dict[int, tuple[weakref.ref[torch.Tensor], torch.Tensor, str, str]] = {}

    def _mark(self, t: Any) -> tuple[torch.Tensor, str, str] | None:
        if not isinstance(t, torch.Tensor):
            return None
        got = self.marks.get(id(t))
        if got is None or got[0]() is not t:
            return None
        return got[1], got[2], got[3]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        try:
            self._see(func, args, out)
        except Exception:  # noqa: BLE001 - a monitor never breaks training
            self.probe.broken = True
        return out

    def _see(self, func: Any, args: Any, out: Any) -> None:
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        if func in _SOURCES:
            self.marks[id(out)] = (weakref.ref(out), out, "p", _SOURCES[func])
            return
        src = self._mark(args[0]) if args else None
        if src is None:
            return
        p, side, name = src
        if func in _SAME:
            self.marks[id(out)] = (weakref.ref(out), p, side, name)
        elif func is _aten.rsub.Scalar and len(args) > 1 and args[1] == 1:
            self.marks[id(out)] = (weakref.ref(out), p, "1-p" if side == "p" else "p", name)
        elif func in _LOGS:
            self.probe.check(p, side, name, func.__name__.split(".")[0])
        elif func is _aten.binary_cross_entropy.default and side == "p" and len(args) > 1:
            self.probe.check_bce(p, args[1], name)


_NEVER = 1 << 62
"""`SaturationProbe.due` of a probe that stood down."""


class SaturationProbe:
    """Sampled saturation precursor for one guard.

    Args:
        guard: the guard whose optimizer steps arm the probe and whose report gets the alarms.
        every: arm for one step every this many steps (>= 1).
    """

    def __init__(self, guard: Host, every: int) -> None:
        self.every = every
        self._guard = weakref.ref(guard)
        self._mode: _Mode | None = None
        self.broken = False
        self.armed_steps = 0  # how many steps the probe watched (for tests and the curious)
        # The index of the step in progress (the guard's count, as `after_step` gives it).
        self.step = guard.step
        self._last_fired: tuple[int, int] | None = None  # (near, exact) counts last said
        self._hits: list[tuple[str, str, str, int, int, str]] = []
        self._opt = guard.optimizer
        self._pre: RemovableHandle | None = self._opt.register_step_pre_hook(self._disarm_hook)
        """The disarm pre-hook while it is needed (an armed step), else None: registered
        first among the optimizer's pre-hooks (the probe leaves before the guard's pre-hook,
        and any replay, runs)."""
        self._movable = callable(getattr(self._pre.hooks_dict_ref(), "move_to_end", None))
        """Whether the pre-hook can be put first again when re-registered (the optimizer's
        hooks are an ordered dict); if not, it stays registered for good."""
        self.due: int = self.step + 1
        """The guard's step count at which `after_step` has something to do next (arm, or
        drop the disarm pre-hook: the first step's drops the one registered here, first in
        line): the guard's post-hook compares, and calls it only then."""

    # -- arm after step n-1 for step n's forward (`after_step`, from the guard's post-hook),
    # disarm before n's update (the pre-hook, registered only while a step is armed).

    def _next_armed(self, step: int) -> int:
        """The first step after `step` the probe arms for."""
        return (step // self.every + 1) * self.every

    def after_step(self, step: int) -> None:
        """Runs in the guard's step post-hook once its step count reached `due`; `step`: the
        index of the step to come. Arms the probe for that step's forward on every `every`-th
        step, else drops the disarm pre-hook once nothing is left to say. Driven by the guard
        (not a post-hook of the probe's own): one step count, and no call on the steps
        between. An error of the probe's own stands the probe down, not the guard."""
        self.step = step
        if self.broken:
            self.remove()
            self.due = _NEVER
            return
        try:
            if step % self.every == 0 and self._mode is None:
                if self._pre is None:  # (not iterating the pre-hooks now: safe to add one)
                    self._pre = self._opt.register_step_pre_hook(self._disarm_hook)
                    hooks = self._pre.hooks_dict_ref()
                    if hooks is not None:  # (the optimizer's, alive: this is its hook)
                        hooks.move_to_end(self._pre.id, last=False)
                self._mode = _Mode(self)
                self._mode.__enter__()
                self.armed_steps += 1
                self.due = step + 1
                return
            if (self._pre is not None and self._movable and self._mode is None
                    and not self._hits):
                # Disarmed, nothing left to say: no pre-hook call until the next armed step.
                self._pre.remove()
                self._pre = None
            self.due = self._next_armed(step)
        except Exception:  # noqa: BLE001 - a monitor never breaks training
            self.broken = True
            self.remove()
            self.due = _NEVER

    def _disarm_hook(self, *_: Any) -> None:
        if self._mode is not None:
            self.disarm()
        guard = self._guard()
        if guard is not None and self._hits:
            hits, self._hits = self._hits, []
            self._alarm(guard, hits)

    def disarm(self) -> None:
        """Leave the dispatch mode (idempotent). Another mode entered after ours and still
        active would make leaving out of order: the probe then stands down for good."""
        mode, self._mode = self._mode, None
        if mode is not None and not leave(mode):
            self.broken = True

    def remove(self) -> None:
        """Disarm and remove the hooks (the guard closed)."""
        self.disarm()
        if self._pre is not None:
            self._pre.remove()
            self._pre = None

    # -- the check

    def check(self, p: torch.Tensor, side: str, source: str, log: str) -> None:
        """A `log` consumed `p` (side `p`) or `1 - p` (side `1-p`): note entries at or near
        the rounding point that would make the log -inf."""
        info = torch.finfo(p.dtype)
        with torch.no_grad():
            if side == "p":
                exact, near = p == 0, p < info.tiny
            else:
                exact, near = p == 1, (1 - p) <= NEAR_ULPS * info.eps / 2
            n_near, n_exact = int(near.sum()), int(exact.sum())
        if n_near:
            self._hits.append((source, side, log, n_near, n_exact, _user_line()))

    def check_bce(self, p: torch.Tensor, target: Any, source: str) -> None:
        """`binary_cross_entropy` consumed `p`: note entries saturated on the wrong side (at
        or near 1 where the target is 0, at or near 0 where it is 1). BCE clamps its logs at
        -100, so the loss never goes NaN there; but the sigmoid's gradient `p * (1 - p)` is
        exactly 0 once `p` rounds to 0 or 1, so those samples stop learning (their loss stuck
        at 100) with nothing non-finite to see. Confident right answers are not counted."""
        if not isinstance(target, torch.Tensor) or target.shape != p.shape:
            return
        info = torch.finfo(p.dtype)
        with torch.no_grad():
            neg = target < 0.5
            near = torch.where(neg, (1 - p) <= NEAR_ULPS * info.eps / 2, p < info.tiny)
            exact = torch.where(neg, p == 1, p == 0)
            n_near, n_exact = int(near.sum()), int(exact.sum())
        if n_near:
            self._hits.append((source, "wrong", "binary_cross_entropy", n_near, n_exact,
                               _user_line()))

    def _alarm(self, guard: Host, hits: list[tuple[str, str, str, int, int, str]]) -> None:
        source, side, log, n_near, n_exact, line = max(hits, key=lambda h: (h[4], h[3]))
        # A sustained condition: said once, again only when it got far worse (exact 0/1 now,
        # or 10x as many entries), not at every armed step.
        last = self._last_fired
        if last is not None and not (n_exact and not last[1]) and n_near < 10 * last[0]:
            return
        self._last_fired = (n_near, n_exact)
        step = self.step
        if side == "wrong":
            guard.record_alarm(Alarm(
                step=step, kind="saturation", signal=source, value=float(n_near),
                message=(f"{source} output saturated on the wrong side of its target: "
                         f"{n_near} entries within rounding of 0 or 1 ({n_exact} exactly), "
                         f"consumed by binary_cross_entropy{f' at {line}' if line else ''}; "
                         "BCE clamps its log at -100, so the loss stays finite, but the "
                         f"{source} gradient p*(1-p) is 0 there: those samples stop learning "
                         "(compute the loss from the logits: "
                         "F.binary_cross_entropy_with_logits)")))
            return
        where = "1.0" if side == "1-p" else "0"
        what = (f"{n_exact} exactly at {where}" if n_exact else
                f"{n_near} within {NEAR_ULPS} ulps of 1.0" if side == "1-p"
                else f"{n_near} below the smallest normal number")
        guard.record_alarm(Alarm(
            step=step, kind="saturation", signal=source, value=float(n_near),
            message=(f"{source} output saturating: {what}, consumed by "
                     f"{log}({'1 - p' if side == '1-p' else 'p'})"
                     f"{f' at {line}' if line else ''}; once it rounds to exactly {where}, "
                     f"{log} gives -inf and the loss NaN (compute the loss from the logits: "
                     "F.binary_cross_entropy_with_logits, F.logsigmoid, F.log_softmax)")))


def _user_line() -> str:
    """`file:line: code` of the innermost frame outside torch and nanguard (the log's line)."""
    for frame in reversed(traceback.extract_stack(sys._getframe(1))):
        name = frame.filename
        if name.startswith(_SKIP_DIRS) or name.startswith("<"):
            continue
        code = (frame.line or linecache.getline(name, frame.lineno or 0)).strip()
        return f"{name}:{frame.lineno}: {code}"
    return ""


def attach(guard: Host, every: int) -> SaturationProbe | None:
    """The guard's probe, armed one step in `every` (`DetectConfig.saturation_every`; None
    when it is 0)."""
    return SaturationProbe(guard, every) if every else None
