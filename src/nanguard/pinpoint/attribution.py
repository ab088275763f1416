"""Where an op runs: phase, module path, source line and, in the optimizer, the parameter.

The phase comes from hooks, not guesses:

* `forward`: while a model's forward runs (global module forward pre/post hooks; a module with
  parameters entered when no model forward is running is a model root);
* `loss`: after a model's forward returned and before backward starts;
* `backward`: while the autograd engine runs a node (`torch._C._current_autograd_node()`), and
  afterwards until the optimizer steps (gradient clipping and other gradient edits);
* `optimizer`: inside `optimizer.step()` (step pre/post hooks);
* `data` is never the phase of an op: it names non-finite values already present in the batch
  (the checker sets it for those). An op that computes a non-finite value from finite inputs
  before the first model forward of the step is `forward` (outside every module: batch
  preprocessing feeding the model) when a model is known.

In code with no `nn.Module` at all (raw tensors: `h = torch.sigmoid(X @ W + b)`, `cost = -(Y *
log(h) ...)`) no hook tells the model's forward from its loss; the ops do (`note_op`). The
loss begins at the step's first log (`log`, `log1p`, `log_softmax`, `xlogy`, ...: where a
hand-written loss takes the log of a probability), its first loss function (`mse_loss`,
`nll_loss`, `binary_cross_entropy`, ...) or its first pick of one entry per row at the targets
(`probs[torch.arange(n), ys]`: an index with two or more index tensors); ops before it are
`forward` (the scratch model: `X @ W`, its softmax's `exp`, a batch norm's `std`).

Backward ops are attributed through their autograd node: forward ops record (module, source)
into the `metadata` of the node that autograd attaches to their output, and each module's
forward post-hook tags the nodes its forward created that are still untagged (custom autograd
Functions, whose outputs get their node outside the dispatcher).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

TAG = "nanguard_origin"
"""Key in `grad_fn.metadata`: (module path, forward source line)."""

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# The standard library is nobody's training code either (a DataLoader worker's batch arrives
# through multiprocessing's queues): a source line there would point away from the script.
_STDLIB_DIR = os.path.dirname(os.__file__) + os.sep
_SITE_DIRS = tuple(sorted({sysconfig.get_paths()[k] + os.sep for k in ("purelib", "platlib")}))
"""Installed packages (a transformers model's code) are user code: they may sit below the
standard library's folder."""
_NANGUARD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Demo training scripts shipped inside the package count as user code.
_USER_DIRS = (os.path.join(_NANGUARD_DIR, "scenarios") + os.sep,)
_internal: dict[str, bool] = {}

_LOSS_OPS = frozenset({
    "log", "log2", "log10", "log1p", "xlogy", "log_softmax", "_log_softmax",
    "log_sigmoid_forward", "mse_loss", "l1_loss", "nll_loss", "nll_loss2d", "nll_loss_nd",
    "cross_entropy_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "smooth_l1_loss", "huber_loss", "kl_div", "soft_margin_loss", "margin_ranking_loss",
    "hinge_embedding_loss", "poisson_nll_loss", "multi_margin_loss", "multilabel_margin_loss",
})
"""Ops that begin a loss in code with no `nn.Module` (`Attribution.note_op`)."""


def is_internal(filename: str) -> bool:
    hit = _internal.get(filename)
    if hit is None:
        hit = filename.startswith(("<", _TORCH_DIR)) or (
            filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIRS)) or (
            filename.startswith(_NANGUARD_DIR) and not filename.startswith(_USER_DIRS))
        _internal[filename] = hit
    return hit


_ANCHORS: dict[int, list[str | None]] = {}
"""id(frame) -> the user's lines nanguard's own code stands in for there, innermost last
(`replayed_at`, `replay_boundary`). Empty while no replay runs."""


class replayed_at:  # noqa: N801 - used as a context manager, like `contextlib.suppress`
    """While the block runs, the frame that entered it stands for the user's line `source`:
    nanguard calls again, in its own code, what the user called at `source` (a replayed
    model call or loss, `pinpoint/recipe.py`), so an op reached through that frame ran at
    `source` in the user's code. `source` None marks a boundary (`replay_boundary`): the
    frames above are those that triggered the replay (the `optimizer.step()` whose hook
    runs it), never the line of an op inside it, and `user_source` stops there."""

    __slots__ = ("_key", "_source")

    def __init__(self, source: str | None) -> None:
        self._source = source
        self._key = id(sys._getframe(1))

    def __enter__(self) -> None:
        _ANCHORS.setdefault(self._key, []).append(self._source)

    def __exit__(self, *exc: object) -> None:
        stack = _ANCHORS.get(self._key)
        if stack:
            stack.pop()
            if not stack:
                del _ANCHORS[self._key]


def replay_boundary() -> replayed_at:
    """`replayed_at(None)` for the calling frame: `user_source` never looks above it."""
    b = replayed_at(None)
    b._key = id(sys._getframe(1))
    return b


def user_source() -> str | None:
    """`path:line` of the user's frame where the running op was called, or None.

    That is the innermost frame outside torch and nanguard, except in a replay: there the
    walk stops at the frame nanguard replays from and takes the user's line it stands for
    (`replayed_at`), or None at a replay's boundary; a frame above it (the line whose
    `optimizer.step()` triggered the replay) is not where the op ran."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not is_internal(name):
            return f"{_short(name)}:{f.f_lineno}"
        if _ANCHORS:
            stack = _ANCHORS.get(id(f))
            if stack:
                return stack[-1]
        f = f.f_back  # type: ignore[assignment]
    return None


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


class Attribution:
    """Tracks phase and module while installed; see the module docstring.

    Args:
        model: the model (names come from its `named_modules()`); None discovers model roots
            as they run (any module with parameters entered outside a model forward).
        batch_size: the batch dimension for `samples`; None takes the leading dimension of the
            first tensor given to the first model forward.
    """

    def __init__(self, *, model: nn.Module | None = None, batch_size: int | None = None) -> None:
        self.names: dict[int, str] = {}
        self.roots: list[nn.Module] = []
        if model is not None:
            self._add_root(model)
        self.batch_size = batch_size
        self.optimizer: torch.optim.Optimizer | None = None
        """The optimizer whose `step()` is running, if any."""
        self.seen_forward = False
        self.seen_backward = False
        self.seen_loss = False
        """No-module code only: the step's loss has begun (`note_op`)."""
        self._stack: list[str | None] = []
        self._depth = 0
        self._pending: list[tuple[weakref.ref[torch.Tensor], tuple[str | None, str | None]]] = []
        self._handles: list[RemovableHandle] = []
        self.on_optimizer: list[Any] = []
        self.on_model_input: list[Any] = []
        """Called with the positional inputs of each top-level model forward (the batch)."""
        """Called with the optimizer when its step starts (the checker scans its state)."""

    # ------------------------------------------------------------------ hooks

    def install(self) -> Attribution:
        """Register the global module forward hooks (removed by `remove`)."""
        mm = torch.nn.modules.module
        # always_call: a forward that raises (the script's own NaN check) still pops its
        # module, or every later op would be taken for that module's forward.
        self._handles += [mm.register_module_forward_pre_hook(self._pre),
                          mm.register_module_forward_hook(self._post, always_call=True)]
        return self

    def hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Mark `optimizer.step()` as the optimizer phase (per-optimizer hooks)."""
        self._handles += [optimizer.register_step_pre_hook(self.optimizer_pre),
                          optimizer.register_step_post_hook(self.optimizer_post)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()

    def optimizer_pre(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.flush_pending()
        self.optimizer = optimizer
        for fn in self.on_optimizer:
            fn(optimizer)

    def optimizer_post(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.optimizer = None
        self.seen_forward = self.seen_backward = self.seen_loss = False

    def _add_root(self, root: nn.Module) -> None:
        self.roots.append(root)
        for name, m in root.named_modules(remove_duplicate=False):
            self.names.setdefault(id(m), name)

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is None:
            if self._depth:  # a module unknown to the model, running inside it
                name = next(n for n in reversed(self._stack) if n is not None)
            elif next(module.parameters(), None) is not None:
                self._add_root(module)
                name = ""
        if name is not None and self._depth == 0:
            self.seen_forward, self.seen_backward = True, False
            if self.batch_size is None:
                first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim()), None)
                self.batch_size = None if first is None else int(first.shape[0])
            for fn in self.on_model_input:
                fn(args)
        self._stack.append(name)
        self._depth += name is not None

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack:
            return
        name = self._stack.pop()
        if name is None:
            return
        self._depth -= 1
        self.flush_pending()
        if torch.is_grad_enabled():
            _tag_graph(output, (name, None))

    # ------------------------------------------------------------------ queries

    def phase(self) -> str:
        """The phase of the op running now (see the module docstring); never `data`."""
        if self.optimizer is not None:
            return "optimizer"
        if torch._C._current_autograd_node() is not None or self.seen_backward:
            return "backward"
        if self._depth:
            return "forward"
        if self.seen_forward or (not self.roots and self.seen_loss):
            return "loss"
        return "forward"

    def note_op(self, name: str, args: Any) -> None:
        """Before an op runs outside backward and the optimizer, in code with no model known:
        mark the start of the step's loss (see the module docstring). A name compare per op;
        only while a checker runs."""
        if self.roots or self.seen_loss:
            return
        if name in _LOSS_OPS or (name == "index" and len(args) > 1
                                 and isinstance(args[0], torch.Tensor)
                                 and args[0].is_floating_point()
                                 and isinstance(args[1], (list, tuple))
                                 and sum(i is not None for i in args[1]) > 1):
            self.seen_loss = True

    def module(self) -> str | None:
        """The innermost model module whose forward is running, or None."""
        return next((n for n in reversed(self._stack) if n is not None), None)

    def defer_tag(self, outputs: list[torch.Tensor], source: str | None) -> None:
        """Remember forward outputs: their autograd node is attached after the op returns."""
        info = (self.module(), source)
        self._pending.extend((weakref.ref(t), info) for t in outputs)

    def flush_pending(self) -> None:
        """Tag the autograd nodes of the outputs `defer_tag` remembered. Called before each op
        the checker sees: by then the previous op's outputs have their `grad_fn`."""
        if not self._pending:
            return
        for ref, info in self._pending:
            t = ref()
            fn = None if t is None else t.grad_fn
            if fn is not None:
                _metadata(fn).setdefault(TAG, info)
        self._pending.clear()

    def param_names(self) -> dict[int, str]:
        """id -> parameter name for the running optimizer's params, their grads and state."""
        by_param: dict[int, str] = {}
        for root in self.roots:
            for n, p in root.named_parameters(remove_duplicate=False):
                by_param.setdefault(id(p), n)
        out: dict[int, str] = {}
        opt = self.optimizer
        if opt is None:
            return {k: v for k, v in by_param.items()}
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                name = by_param.get(id(p), f"param_groups.{g}.params.{i}")
                out[id(p)] = name
                if p.grad is not None:
                    out[id(p.grad)] = name
                for v in opt.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor):
                        out[id(v)] = name
        return out


def node_origin(node: Any) -> tuple[str | None, str | None]:
    """(module, forward source) recorded for an autograd node, or (None, None)."""
    tag = _metadata(node).get(TAG) if node is not None else None
    return (tag[0], tag[1]) if tag else (None, None)


def _tag_graph(output: Any, info: tuple[str | None, str | None]) -> None:
    """Tag the not-yet-tagged nodes reachable from `output` (stops at tagged ones)."""
    todo = [t.grad_fn for t in _tensors(output) if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        md = _metadata(node)
        if TAG in md:
            continue
        md[TAG] = info
        todo.extend(n for n, _ in node.next_functions if n is not None)


def _metadata(node: Any) -> dict[str, Any]:
    """`node.metadata` (a dict kept on the autograd node; typed loosely in torch's stubs)."""
    md: dict[str, Any] = getattr(node, "metadata")  # noqa: B009
    return md


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []
