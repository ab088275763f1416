"""`nanguard run --preflight`: the preflight of a script that knows nothing of nanguard.

`LivePreflight` watches an unmodified script (driven by `run.discovery.Discovery`)
until its first optimizer step, and then runs `preflight` on copies of what it saw:

* the model: the root module whose output the loss was computed from, and the positional
  arguments of that forward call (the batch);
* the loss: the `torch.nn.functional` loss (`cross_entropy`, `mse_loss`, ...: loss modules call
  these too) whose result was backpropagated (or is a term of what was), its other arguments
  (targets, `weight`, `reduction`, `label_smoothing`, ...) and how its input came from the
  model's output (the output itself, an element of a tuple / dict output, a reshape of it);
* the optimizer: the one stepping, for its class and hyperparameters (its LR: the larger of the
  current one and a scheduler's base LR).

It runs at the start of that first `optimizer.step()`, before any guard exists or acts, with
every other hook of nanguard quiet (`Discovery.quiet`), on deep copies made without hooks and
inside `torch.random.fork_rng`: the script's model, optimizer, gradients and RNG streams are
left bit for bit as they were. What it cannot do (no loss found, a batch changed in place since
the forward, hand-written updates, an optimizer class that cannot be rebuilt) it says in one
line, and training goes on. Until then the cost is a few attribute reads per root forward and
per loss call; afterwards none (the patched loss functions pass straight through).
"""

from __future__ import annotations

import functools
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nanguard.audit.common import one_line
from nanguard.audit.preflight import PreflightConfig, preflight, user_lr

LOSS_FUNCTIONS = (
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
    "gaussian_nll_loss", "soft_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
)
"""`torch.nn.functional` losses whose first argument is the model's prediction."""

LIVE_CONFIG = PreflightConfig(overfit_steps=100, lr_steps=40)
"""What `nanguard run --preflight` runs (a few seconds on the CPU demo models)."""
MAX_ROWS = 64
"""Rows of the batch the preflight trains on (all tensors sharing a first dimension)."""


class PreflightStop(BaseException):
    """`--preflight-only`: raised in the script's first `optimizer.step()` after the verdict.
    A BaseException, so that a script's `except Exception` does not swallow it."""


@dataclass
class _RootCall:
    module: Any
    args: tuple[Any, ...]
    versions: list[tuple[Any, int]]
    output: Any = None


@dataclass
class _LossCall:
    name: str
    fn: Callable[..., Any]
    root: _RootCall | None
    path: tuple[Any, ...]
    shape: tuple[int, ...] | None
    rest: tuple[Any, ...]
    kwargs: dict[str, Any]
    result: Any
    versions: list[tuple[Any, int]] = field(default_factory=list)


def _tensors(obj: Any) -> Iterator[Any]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from _tensors(v)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


def tensor_versions(*objs: Any) -> list[tuple[Any, int]]:
    return [(t, t._version) for o in objs for t in _tensors(o)]


def find_path(output: Any, x: Any, path: tuple[Any, ...] = (), depth: int = 0
          ) -> tuple[tuple[Any, ...], tuple[int, ...] | None] | None:
    """Where `x` (the loss's input) sits in a module's output: its path, and the shape to
    reshape to when `x` is a view of it with another shape (`logits.view(-1, V)`)."""
    import torch

    if isinstance(output, torch.Tensor):
        if x is output:
            return path, None
        try:
            same = (x.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
                    and x.numel() == output.numel() and x.storage_offset() == 0
                    and output.storage_offset() == 0)
        except (RuntimeError, NotImplementedError):
            same = False
        if same:
            return path, (None if x.shape == output.shape else tuple(x.shape))
        return None
    if depth >= 2:
        return None
    items: Any = ()
    if isinstance(output, (tuple, list)):
        items = enumerate(output)
    elif isinstance(output, dict):
        items = output.items()
    for k, v in items:
        found = find_path(v, x, (*path, k), depth + 1)
        if found is not None:
            return found
    return None


def select_path(output: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        output = output[k]
    return output


def _reaches(start: Any, target: Any, limit: int = 5000) -> bool:
    """The autograd node `target` is in the graph below `start`."""
    seen: set[int] = set()
    todo = [start]
    while todo and len(seen) < limit:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        if node is target:
            return True
        seen.add(id(node))
        todo.extend(n for n, _ in getattr(node, "next_functions", ()))
    return False


def wrap_call(name: str, original: Callable[..., Any], me: weakref.ref[LivePreflight]
          ) -> Callable[..., Any]:
    """`original`, telling the live preflight about each call until it has run."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        live = me()
        if live is not None and not live.done:
            live._saw_loss(name, original, args, kwargs, out)
        return out

    return functools.update_wrapper(wrapper, original)


class LivePreflight:
    """Collects the model call, loss call and backward of a running script and runs the
    preflight at its first optimizer step (see the module docstring).

    Args:
        only: `--preflight-only`: raise `PreflightStop` after the verdict.
        config: The preflight's step counts and thresholds.
        say: Where the verdict lines go (stderr by default).
    """

    def __init__(self, *, only: bool = False, config: PreflightConfig | None = None,
                 say: Callable[[str], None] | None = None) -> None:
        self.only = only
        self.config = config or LIVE_CONFIG
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.done = False
        self.result: dict[str, Any] | None = None
        """The verdict (`to_json` form), once the preflight ran or said why it could not."""
        self._calls: list[_RootCall] = []
        self._losses: list[_LossCall] = []
        self._backward: Any = None
        self._patched: dict[str, Callable[..., Any]] = {}

    # ------------------------------------------------------------------ install / remove

    def install(self) -> LivePreflight:
        """Wrap the `torch.nn.functional` losses (they pass through unchanged)."""
        import torch.nn.functional as F

        me = weakref.ref(self)
        for name in LOSS_FUNCTIONS:
            original = getattr(F, name, None)
            if original is None or name in self._patched:
                continue

            wrapper = wrap_call(name, original, me)
            self._patched[name] = original
            setattr(F, name, wrapper)
        return self

    def remove(self) -> None:
        """Restore the loss functions and drop every reference kept (idempotent)."""
        import torch.nn.functional as F

        for name, original in self._patched.items():
            setattr(F, name, original)
        self._patched = {}
        self._release()

    def _release(self) -> None:
        self._calls, self._losses, self._backward = [], [], None

    # ------------------------------------------------------------------ what the script does

    def saw_root_forward(self, module: Any, args: tuple[Any, ...]) -> None:
        """A root module's forward starts (grad enabled): a batch candidate."""
        if self.done:
            return
        self._calls = [*self._calls[-7:], _RootCall(module, tuple(args), tensor_versions(args))]

    def saw_root_output(self, module: Any, output: Any) -> None:
        if self.done:
            return
        for call in reversed(self._calls):
            if call.module is module and call.output is None:
                call.output = output
                return

    def saw_backward(self, tensor: Any) -> None:
        if not self.done and tensor.numel() == 1 and tensor.grad_fn is not None:
            self._backward = tensor

    def _saw_loss(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any], out: Any) -> None:
        import torch

        try:
            if not torch.is_grad_enabled():
                return
            kwargs = dict(kwargs)
            x = args[0] if args else kwargs.pop("input", None)
            rest = tuple(args[1:]) if args else ()
            if not isinstance(x, torch.Tensor) or x.grad_fn is None:
                return
            for call in reversed(self._calls):
                if call.output is None:
                    continue
                found = find_path(call.output, x)
                if found is not None:
                    path, shape = found
                    self._losses = [*self._losses[-7:], _LossCall(
                        name, fn, call, path, shape, rest, kwargs, out,
                        tensor_versions(rest, kwargs))]
                    return
            self._losses = [*self._losses[-7:],
                            _LossCall(name, fn, None, (), None, rest, kwargs, out)]
        except Exception:  # noqa: BLE001 - never in the script's way
            return

    # ------------------------------------------------------------------ the preflight

    def at_first_step(self, optimizer: Any, *, manual: bool = False) -> dict[str, Any]:
        """Run the preflight (once), print the verdict, keep it in `result`; under
        `--preflight-only` raise `PreflightStop` afterwards. Never raises anything else.

        Args:
            optimizer: The optimizer whose first step this is.
            manual: The script updates its parameters by hand (no optimizer class to probe).
        """
        started = time.monotonic()
        self.done = True
        try:
            result = self._run(optimizer, manual)
        except Exception as exc:  # noqa: BLE001 - a preflight never stops training
            result = {"ran": False,
                      "reason": f"the preflight failed: {type(exc).__name__}: {one_line(exc)}"}
        result["seconds"] = round(time.monotonic() - started, 3)
        self.result = result
        self._release()
        for line in verdict_lines(result, only=self.only):
            self.say(line)
        if self.only:
            raise PreflightStop()
        return result

    def not_run(self, reason: str) -> dict[str, Any]:
        """The verdict of a preflight that never got its chance (e.g. no optimizer stepped)."""
        self.done = True
        self.result = {"ran": False, "reason": reason, "seconds": 0.0}
        self._release()
        return self.result

    def _pick_loss(self) -> tuple[_LossCall | None, str | None]:
        """The loss call that was backpropagated (or is a term of it), or why there is none."""
        if self._backward is None:
            return None, "no backward() of a scalar loss ran before the first optimizer step"
        exact = [c for c in self._losses if c.result is self._backward]
        part = [c for c in self._losses if c not in exact and getattr(c.result, "grad_fn", None)
                is not None and _reaches(self._backward.grad_fn, c.result.grad_fn)]
        for c in reversed(exact + part):
            if c.root is not None:
                return c, None if c in exact else "term"
        if exact or part:
            c = (exact + part)[-1]
            return None, (f"the loss ({c.name}) is not computed from the model's output "
                          "itself (ops between them cannot be replayed)")
        return None, ("the loss is not found: no torch.nn.functional loss (cross_entropy, "
                      "mse_loss, ...) or nn loss module made the loss backpropagated before the "
                      "first step; call nanguard.preflight(model, batch, loss_fn, optimizer) "
                      "in the script")

    def _run(self, optimizer: Any, manual: bool) -> dict[str, Any]:
        import torch

        if manual:
            return {"ran": False, "reason": "the script updates its parameters by hand (no "
                    "optimizer steps): the LR probe and the overfit check need an optimizer"}
        loss, why = self._pick_loss()
        if loss is None:
            return {"ran": False, "reason": why}
        call = loss.root
        assert call is not None
        if any(t._version != v for t, v in (*call.versions, *loss.versions)):
            return {"ran": False, "reason": "the batch cannot be replayed: the script changed "
                    "it in place after the forward"}
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not any(id(p) in held for p in call.module.parameters()):
            return {"ran": False, "reason": f"the optimizer that stepped first "
                    f"({type(optimizer).__name__}) trains none of the parameters of "
                    f"{type(call.module).__name__}, the model the loss came from"}
        args, rest, kwargs, rows = _subset(call.args, loss.rest, loss.kwargs)
        fn, path, shape = loss.fn, loss.path, loss.shape

        def loss_fn(out: Any, targets: Any) -> Any:
            x = select_path(out, path)
            if shape is not None:
                x = x.reshape(-1, *shape[1:]) if rows is not None and len(shape) > 1 else \
                    x.reshape(shape)
            return fn(x, *targets[0], **targets[1])

        report = preflight(call.module, (args, (rest, kwargs)), loss_fn, optimizer,
                           config=self.config)
        shapes = [list(t.shape) for t in _tensors(args)]
        result: dict[str, Any] = {
            "ran": True,
            "model": type(call.module).__name__,
            "loss": loss.name,
            "optimizer": {"class": type(optimizer).__name__, "lr": user_lr(optimizer)},
            "batch": {"shapes": shapes, "rows_used": rows},
            "device": str(next(iter(call.module.parameters()), torch.empty(0)).device),
            "errors": len(report.errors),
            "warnings": sum(1 for f in report.findings if f.severity == "warning"),
            **report.to_dict(),
        }
        if why == "term":
            result["note"] = (f"the loss backpropagated has other terms besides {loss.name}; "
                              f"the preflight used {loss.name} alone")
        return result


def _subset(args: tuple[Any, ...], rest: tuple[Any, ...], kwargs: dict[str, Any]
            ) -> tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any], int | None]:
    """The first `MAX_ROWS` rows when every batch tensor (inputs, targets) shares its first
    dimension; else everything. Returns the (sliced) parts and the rows used (None: all)."""
    import torch

    batch = [t for t in _tensors((args, rest)) if t.dim() > 0]
    sizes = {t.shape[0] for t in batch}
    if len(sizes) != 1 or next(iter(sizes)) <= MAX_ROWS:
        return args, rest, kwargs, None

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return obj[:MAX_ROWS] if obj.dim() > 0 else obj
        if isinstance(obj, tuple):
            return tuple(cut(v) for v in obj)
        if isinstance(obj, list):
            return [cut(v) for v in obj]
        return obj

    return cut(args), cut(rest), kwargs, MAX_ROWS


# ---------------------------------------------------------------------- the verdict


def verdict_lines(result: dict[str, Any], *, only: bool = False) -> list[str]:
    """The verdict as printed: a header, one line per finding (a layer group for init),
    the probe and overfit results, and what happens next."""
    head = "nanguard preflight"
    seconds = float(result.get("seconds") or 0.0)
    if not result.get("ran"):
        nxt = "" if only else "; training continues"
        return [f"{head}: not run ({seconds:.1f} s): {result.get('reason')}{nxt}"]
    opt = result.get("optimizer") or {}
    lr = opt.get("lr")
    rows = (result.get("batch") or {}).get("rows_used")
    lines = [f"{head}: {result.get('model')}, {opt.get('class')}"
             + (f" lr={lr:g}" if isinstance(lr, (int, float)) else "")
             + f", loss {result.get('loss')}"
             + (f", first {rows} rows of the batch" if rows else "")
             + f" ({seconds:.1f} s)"]
    findings = list(result.get("findings") or [])
    init = [f for f in findings if f["code"] == "exploding_init"]
    if init:
        names = [f"{f['location'] or 'model'} (std {f['details']['std']:.3g}, "
                 f"{f['details']['ratio']:.3g}x)" for f in init]
        more = f" (+{len(names) - 4} more)" if len(names) > 4 else ""
        call = init[0]["details"].get("init_call") or init[0]["fix"]
        lines.append(f"  error exploding_init: {len(init)} layer(s) with weight std far above "
                     f"1/sqrt(fan_in) (Kaiming gives 1.4x): {', '.join(names[:4])}{more}; "
                     f"fix: {call}" + (", the same for each layer listed" if len(init) > 1
                                       else "")
                     + " (or drop the custom init: PyTorch's default gives 0.58x)")
    for f in findings:
        if f["code"] == "exploding_init":
            continue
        fix = f" (fix: {f['fix']})" if f.get("fix") else ""
        lines.append(f"  {f['severity']} {f['code']}: {f['message']}{fix}")
    probe = result.get("lr_probe") or {}
    if probe:
        div = probe.get("diverge_lr")
        lines.append("  LR probe: " + (f"the loss diverges at lr {div:.2g} on this batch"
                                        if div else "the loss never diverged up to lr "
                                        f"{(probe.get('lrs') or [0])[-1]:.2g}"))
    o = result.get("overfit") or {}
    if o:
        at = f" at lr {o['lr']:.2g}" if o.get("lr") is not None else ""
        lines.append(f"  overfit one batch{at}: {'ok' if o.get('success') else 'FAILED'} "
                     f"(loss {_f(o.get('first_loss'))} -> {_f(o.get('final_loss'))} in "
                     f"{o.get('steps')} steps)")
    if result.get("note"):
        lines.append(f"  note: {result['note']}")
    # Problems, not findings: the init's one finding per layer is one problem (one line).
    errors, warnings = (_problems(findings, level) if findings else int(result.get(key) or 0)
                        for level, key in (("error", "errors"), ("warning", "warnings")))
    word = (f"{errors} error-level finding(s)" if errors else "no errors") + (
        f", {warnings} warning(s)" if warnings else "")
    nxt = (" (exit 1)" if errors else " (exit 0)") if only else "; training continues"
    lines.append(f"  verdict: {word}{nxt}")
    return lines


def _problems(findings: list[dict[str, Any]], severity: str) -> int:
    """The problems of a severity as the verdict lists them: the layers of `exploding_init`
    are one."""
    codes = [f["code"] for f in findings if f.get("severity") == severity]
    return len([c for c in codes if c != "exploding_init"]) + ("exploding_init" in codes)


def _f(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)
