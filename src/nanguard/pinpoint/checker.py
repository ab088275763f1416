"""The op-level checker: a `TorchDispatchMode` that finds the op where a non-finite value began.

Every aten op (forward, backward, inside `optimizer.step()`, custom autograd Functions
included) passes through `__torch_dispatch__`. The per-op cost is one reduction and one host
read on its floating outputs (`all_finite`); inputs are looked at only when an output is
non-finite, and in-place ops check the tensor they overwrite before it is overwritten.

Non-finite tensors are tracked by identity (weak references), each with a label:

* **intended**: made on purpose, e.g. the `-inf` of an attention mask (`masked_fill`, `full`,
  `fill_`, any op given a python scalar +-inf, `lift_fresh` of `torch.tensor(-inf)`, 0-d
  constants), and whatever such values flow into as long as no NaN appears. Never an origin;
  the op that turns them into NaN (softmax of a fully masked row) is one.
* **tainted** by a candidate: an op that produced a non-finite value from finite (or intended)
  inputs opens a candidate; its outputs carry the candidate's label, and so do the outputs of
  every op that carries the value on.

A candidate becomes the origin once its value flows on (a later op with a tainted input has a
non-finite output; pure views and copies defer that), or when it is still alive and non-finite
at the end of the run (a parameter written by the optimizer). A candidate healed in place
(`x / norm` then `masked_fill_(norm == 0, 0)`, as `linalg_vector_norm`'s backward does) or
freed unused never becomes one.

A candidate *absorbed* by a later op (read by it, the op's output finite: `nll_loss` or
`gather` read only the target entries of a `log` that is `-inf` elsewhere, `clamp` or `where`
cut it off) is still the origin when the NaN it causes shows up in backward: the backward op
that makes a NaN from finite inputs (`LogBackward0`'s `grad / x` at `x == 0`) runs for a node
created on the same source line as the absorbed value. With no origin at all at the end, the
earliest absorbed candidate is the origin. Non-finite inputs that no op made (the batch, a corrupted
parameter) open a candidate of kind `input` or `state`. After the origin is settled the mode
only passes ops through.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nanguard.pinpoint import entered
from nanguard.pinpoint.attribution import Attribution, node_origin, user_source
from nanguard.pinpoint.op_args import op_args
from nanguard.pinpoint.origin import (
    InputRange,
    Origin,
    all_finite,
    float_tensors,
    has_nan,
    input_ranges,
    nonfinite_rows,
    output_summary,
)

# Ops whose non-finite output is made on purpose (given no python scalar +-inf).
_FILL_OPS = frozenset({
    "lift_fresh", "lift_fresh_copy", "scalar_tensor", "empty", "empty_like", "new_empty",
    "empty_strided", "new_empty_strided", "empty_permuted", "resize_",
})
# Ops that adopt memory made elsewhere (a DataLoader worker's batch arrives through shared
# memory as `set_` of a storage; a file mapped in): a non-finite value they yield came with
# the data, not from a computation of this process.
_ADOPT_OPS = frozenset({"set_", "from_file"})
# Ops that move values without computing: they carry a candidate on without settling it.
_TRANSPORT_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze",
    "expand", "detach", "alias", "select", "slice", "as_strided", "unbind", "split",
    "split_with_sizes", "chunk", "narrow", "diagonal", "clone", "_to_copy", "copy_", "copy",
    "contiguous", "lift_fresh", "view_as_real", "view_as_complex", "unfold",
})
# Ops that assemble a batch from pieces: the rows of their output are the batch's rows.
_ASSEMBLE_OPS = frozenset({"stack", "cat", "index", "index_select", "_unsafe_index", "gather",
                           "take", "repeat", "flip", "roll", "constant_pad_nd"})
# Ops that make a tensor from Python values (`torch.tensor(rows)`): a NaN they hold was read.
_FROM_PYTHON_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})
_mutated_cache: dict[Any, tuple[int, ...]] = {}


def _mutated(func: Any) -> tuple[int, ...]:
    """Positions of the arguments `func` writes in place (from its schema)."""
    hit = _mutated_cache.get(func)
    if hit is None:
        hit = tuple(i for i, a in enumerate(func._schema.arguments)
                    if a.alias_info is not None and a.alias_info.is_write)
        _mutated_cache[func] = hit
    return hit


@dataclass(kw_only=True)
class _Candidate:
    origin: Origin
    refs: list[weakref.ref[torch.Tensor]] = field(default_factory=list)
    confirmed: bool = False
    absorbed: bool = False
    """Read by a later op whose outputs were finite (and not healed in place)."""
    healed: bool = False
    persists: bool = True
    """Counts as the origin if still alive and non-finite at the end (not for the batch)."""


class NonfiniteChecker(TorchDispatchMode):
    """Finds the origin of the first non-finite value among the ops it sees.

    Use as a context manager around a training step, then call `finish()`; `origin` is the
    result (None when nothing non-finite was produced). Needs an `Attribution` installed for
    phases and module names.

    Args:
        attribution: the phase/module tracker (installed by the caller).
        step: step index written into the origin.
        rank: distributed rank written into the origin.
    """

    def __init__(self, attribution: Attribution, *, step: int | None = None, rank: int = 0):
        super().__init__()
        self.attr = attribution
        self.step = step
        self.rank = rank
        self.origin: Origin | None = None
        self.done = False
        self.ops_seen = 0
        self._cands: list[_Candidate] = []
        self._taint: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._intended: dict[int, weakref.ref[torch.Tensor]] = {}
        self._fresh: weakref.ref[torch.Tensor] | None = None
        attribution.on_optimizer.append(self._scan_state)
        attribution.on_model_input.append(self._batch_rows)

    # ------------------------------------------------------------------ public

    def seed_batch(self, batch: Any) -> None:
        """Register the batch: a non-finite element opens a `data` candidate at once."""
        for key, t in _named_tensors(batch):
            if t.is_floating_point() and not all_finite([t]):
                rows = nonfinite_rows(t, t.shape[0] if t.dim() else None)
                o = Origin(phase="data", kind="input", samples=rows, batch_item=key,
                           step=self.step, rank=self.rank)
                self._open(o, [t], persists=False)
                break

    def finish(self) -> Origin | None:
        """Settle the origin at the end of the run (also called by `__exit__`)."""
        if not self.done:
            for k, c in enumerate(self._cands):
                if c.confirmed or (c.persists and self._alive(k, recheck=True)):
                    j = None if c.confirmed else self._absorbed_before(k)
                    if j is not None:
                        self._cands[j].origin.propagated_by = {
                            "op": c.origin.op, "phase": c.origin.phase,
                            "module": c.origin.module, "node": c.origin.node}
                    self.origin = (c if j is None else self._cands[j]).origin
                    break
            else:
                absorbed = [c for c in self._cands if c.absorbed and not c.healed
                            and c.origin.kind == "op"]
                if absorbed:
                    self.origin = absorbed[0].origin
            self.done = True
        o = self.origin
        if (o is not None and (o.kind == "input" or o.phase == "data")
                and "file" not in (o.entered or {})):
            refs = [r for c in self._cands if c.origin is o for r in c.refs]
            entered.place(o, [t for r in refs if (t := r()) is not None])
        return self.origin

    def __enter__(self) -> NonfiniteChecker:
        entered.install(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        entered.uninstall(self)
        self.finish()

    def fresh(self, t: torch.Tensor) -> bool:
        """Whether `t` is the last tensor made from Python values that came out non-finite
        and was taken for one made so on purpose (`pinpoint.entered` asks)."""
        return self._fresh is not None and self._fresh() is t and not self.done

    def entered(self, t: torch.Tensor, *, how: str, source: str | None,
                data: InputRange) -> None:
        """`t`, made from numbers that were finite (`data`: their float64 range), overflowed
        on narrowing: it is not an intended inf but a candidate of its own, at `source`."""
        self._fresh = None
        self._intended.pop(id(t), None)
        o = Origin(step=self.step, rank=self.rank, phase="data",
                   module=self.attr.module(), op="aten.lift_fresh", source=source,
                   inputs=[data], kind="op", output=output_summary(t),
                   args={"dtype": str(t.dtype).replace("torch.", "")},
                   entered={"how": how, "source": source})
        self._open(o, [t])

    def _scan_state(self, optimizer: torch.optim.Optimizer) -> None:
        """At the start of `optimizer.step()`: a parameter or state tensor that is already
        non-finite (and untracked) opens a `state` candidate."""
        if self.done:
            return
        ts = [p for g in optimizer.param_groups for p in g["params"]]
        ts += [v for p in ts for v in optimizer.state.get(p, {}).values()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()]
        ts = [t for t in ts if not self._known(t)]
        with torch.no_grad():
            sums = [t.detach().sum().float() for t in ts if t.numel()]
            if sums and all_finite([torch.stack(sums)]):
                return
        names = self.attr.param_names()
        for t in ts:
            if not all_finite([t]):
                self._open(Origin(step=self.step, rank=self.rank, phase="optimizer",
                                  kind="state", param=names.get(id(t))), [t], persists=False)

    # ------------------------------------------------------------------ dispatch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if self.done:
            out = func(*args, **kwargs)
            if self.origin is not None and self.origin.kind == "input" and (
                    self.origin.entered is None):
                entered.follow(self, func, args, kwargs, out)  # a model input or a label?
            return out
        self.ops_seen += 1
        attr = self.attr
        if attr._pending:
            attr.flush_pending()
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward:
            attr.seen_backward = True
        elif (attr.optimizer is not None and getattr(attr.optimizer, "hand_written", False)
              and torch.is_grad_enabled() and _requires_grad(args)):
            # A hand-written update ran under no_grad (or on `.data`); a grad-enabled op on a
            # trained tensor is the next step's forward, although no hook has ended the step
            # yet (raw tensors: no module forward marks it; the boundary is the next backward).
            attr.optimizer_post(attr.optimizer)
        if not in_backward and attr.optimizer is None and not attr.roots:
            attr.note_op(func.overloadpacket.__name__, args)  # where a scratch loss begins
        mutated = _mutated(func)
        targets = float_tensors([args[i] for i in mutated if i < len(args)]) if mutated else []
        # What an in-place op overwrites must be checked first. Inside optimizer.step() the
        # parameters and state were scanned once at its start (`_scan_state`) instead.
        pre_bad = {id(t) for t in targets if not self._known(t) and not all_finite([t])
                   } if targets and attr.optimizer is None else set()
        out = func(*args, **kwargs)
        outs = float_tensors(out) if out is not None else []
        if targets:
            outs = float_tensors([outs, targets])
        if (not in_backward and attr.optimizer is None and torch.is_grad_enabled()
                and _requires_grad(args)):
            attr.defer_tag(outs, user_source())
        if all_finite(outs):
            for t in targets:  # overwritten with finite values: no longer tracked
                hit = self._taint.pop(id(t), None)
                if hit is not None and hit[0]() is t:
                    self._cands[hit[1]].healed = True
                self._intended.pop(id(t), None)
            if self._cands:
                self._absorb(args, kwargs, target_ids={id(t) for t in targets})
            return out
        self._on_nonfinite(func, args, kwargs, outs, targets, pre_bad)
        return out

    def _on_nonfinite(self, func: Any, args: Any, kwargs: Any, outs: list[torch.Tensor],
                      targets: list[torch.Tensor], pre_bad: set[int]) -> None:
        name = func.overloadpacket.__name__
        target_ids = {id(t) for t in targets}
        ins = float_tensors([*args, *kwargs.values()])
        tainted: list[int] = []
        intended = external = False
        ext: list[torch.Tensor] = []
        for t in ins:
            k = self._label(t)
            if k is not None:
                if k == -1:
                    intended = True
                else:
                    tainted.append(k)
            elif (id(t) in pre_bad) if id(t) in target_ids else not all_finite([t]):
                if t.dim() == 0:  # a constant such as torch.tensor(-inf)
                    intended = True
                else:
                    external = True
                    ext.append(t)
        if name in _ADOPT_OPS and not tainted and not external and outs:
            external, ext = True, [outs[0]]
        elif (not tainted and not external and outs[0].dim() and has_nan(outs)
              and (name in _FROM_PYTHON_OPS
                   or (intended and name in _TRANSPORT_OPS | _ASSEMBLE_OPS))):
            # A NaN read from Python data (`torch.tensor(parsed_rows)` in a Dataset), or moved
            # or assembled (a collate's `stack`, `.float()`) out of constants that held it: no
            # op computed it, it came with the data (a `-inf` mask never holds a NaN).
            external, ext = True, [outs[0]]
        fill = name in _FILL_OPS or _scalar_inf(args, kwargs)
        if fill and not tainted:
            self._mark_intended(outs)
            if name in _FROM_PYTHON_OPS and outs:  # `pinpoint.entered` may say it overflowed
                self._fresh = weakref.ref(outs[0])
            return
        # Written in place through a view (`x[:, c] = torch.log(x[:, c])`): the tensor it views
        # holds the value now, and later ops read that one, not the view. (Not a constant
        # written on purpose, `x[i] = float("nan")`: that stays with the view, as before.)
        bases = [b for t in targets if isinstance(b := t._base, torch.Tensor)
                 and b.is_floating_point() and all(b is not o for o in outs)]
        if external:
            tainted.append(self._open_external(ext[0], outs))
        if tainted:
            low = min(tainted)
            for t in outs + bases:
                self._taint[id(t)] = (weakref.ref(t), low)
                self._cands[low].refs.append(weakref.ref(t))
            if name not in _TRANSPORT_OPS and not fill:
                for k in sorted(set(tainted)):
                    self._confirm(k, name, outs)
                self._settle()
            return
        if intended and not has_nan(outs):
            self._mark_intended(outs)
            return
        self._open(self._describe(name, args, kwargs, ins, outs, func=func),
                   outs if intended else outs + bases)
        self._settle()

    # ------------------------------------------------------------------ candidates

    def _absorb(self, args: Any, kwargs: Any, target_ids: set[int]) -> None:
        """An op read tainted inputs and gave finite outputs: their candidates are absorbed."""
        for t in float_tensors([*args, *kwargs.values()]):
            if id(t) in target_ids:
                continue
            k = self._label(t)
            if k is not None and k >= 0:
                self._cands[k].absorbed = True

    def _absorbed_before(self, k: int) -> int | None:
        """An earlier absorbed candidate made on the forward line that created the backward
        node candidate `k` runs for: the value that caused candidate `k`."""
        o = self._cands[k].origin
        if o.phase != "backward" or o.source is None:
            return None
        for j in range(k):
            c = self._cands[j]
            if (c.absorbed and not c.healed and not c.confirmed and c.origin.kind == "op"
                    and c.origin.source == o.source):
                return j
        return None

    def _phase(self, name: str) -> str:
        """The attribution's phase, except that an op which only moves or assembles values
        before any forward of the step (a collate's `stack`, `.to()`, `.float()`, indexing)
        is loading the batch: `data`, not `loss`."""
        phase = self.attr.phase()
        # No-module code: the scratch forward is `forward` too (`Attribution.note_op`).
        if ((phase == "loss" or (phase == "forward" and not self.attr.roots))
                and not self.attr.seen_forward
                and name in _TRANSPORT_OPS | _ASSEMBLE_OPS | _ADOPT_OPS):
            return "data"
        return phase

    def _describe(self, name: str, args: Any, kwargs: Any, ins: list[torch.Tensor],
                  outs: list[torch.Tensor], *, func: Any = None) -> Origin:
        attr = self.attr
        phase = self._phase(name)
        bad = next(t for t in outs if not all_finite([t]))
        node = torch._C._current_autograd_node()
        module, source, param = attr.module(), None, None
        if node is not None:
            module, source = node_origin(node)
        if source is None:
            source = user_source()
        samples = nonfinite_rows(bad, attr.batch_size)
        if phase == "optimizer":
            samples = []
            param = _param_of(attr.param_names(), args, outs, bad)
            if param is not None:
                module = param.rpartition(".")[0]
        return Origin(step=self.step, phase=phase, module=module, op=f"aten.{name}",
                      source=source, samples=samples, rank=self.rank, param=param,
                      inputs=input_ranges(ins), kind="op",
                      node=None if node is None else node.name(), output=output_summary(bad),
                      args=op_args(func, args, kwargs) if func is not None else {})

    def _open_external(self, t: torch.Tensor, outs: list[torch.Tensor]) -> int:
        names = self.attr.param_names()
        state = id(t) in names or isinstance(t, torch.nn.Parameter)
        o = Origin(step=self.step, rank=self.rank, phase=self.attr.phase() if state else "data",
                   kind="state" if state else "input", param=names.get(id(t)),
                   samples=[] if state else nonfinite_rows(t, t.shape[0]))
        return self._open(o, [t], persists=False)

    def _batch_rows(self, args: Any) -> None:
        """The model's forward receives a batch that carries a value first met in a tensor
        outside the batch (a collate function reading a whole data set): `samples` become the
        rows of the batch, as everywhere else; the data set's rows are kept as `dataset_rows`."""
        for t in float_tensors(list(args)):
            k = self._label(t)
            if k is None or k < 0 or t.dim() == 0:
                continue
            origin = self._cands[k].origin
            if origin.kind == "input" and origin.entered is None:
                origin.entered = {"how": "batch"}  # a model input: not a label
            if origin.kind == "input" and origin.dataset_rows is None:
                # Called from a module hook, outside the dispatch handler: our own ops must not
                # be seen by the checker as the training's.
                with _disable_current_modes():
                    rows = nonfinite_rows(t, t.shape[0])
                origin.dataset_rows = origin.samples
                origin.samples = rows

    def _open(self, origin: Origin, tensors: list[torch.Tensor], persists: bool = True) -> int:
        k = len(self._cands)
        c = _Candidate(origin=origin, persists=persists)
        for t in tensors:
            c.refs.append(weakref.ref(t))
            self._taint[id(t)] = (weakref.ref(t), k)
        self._cands.append(c)
        return k

    def _confirm(self, k: int, name: str, outs: list[torch.Tensor]) -> None:
        c = self._cands[k]
        if c.confirmed:
            return
        c.confirmed = True
        attr = self.attr
        phase, module = self._phase(name), attr.module()
        node = torch._C._current_autograd_node()
        if node is not None:
            module = node_origin(node)[0]
        c.origin.propagated_by = {"op": f"aten.{name}", "phase": phase, "module": module}
        j = self._absorbed_before(k)
        if j is not None:  # the absorbed forward value caused this backward NaN
            earlier = self._cands[j]
            earlier.confirmed = True
            earlier.origin.propagated_by = {"op": c.origin.op, "phase": c.origin.phase,
                                            "module": c.origin.module, "node": c.origin.node}
        o = c.origin
        if o.op is None:  # an input: name the op that consumed it, where it entered the model
            o.op, o.module, o.source = f"aten.{name}", module, user_source()
            if o.kind == "state":
                o.phase = phase

    def _settle(self) -> None:
        """The origin is the earliest candidate once no earlier one can still take its place."""
        for k, c in enumerate(self._cands):
            if c.confirmed:
                self.origin = c.origin
                self.done = True
                return
            if self._alive(k, recheck=False):
                return

    def _alive(self, k: int, *, recheck: bool) -> bool:
        for ref in self._cands[k].refs:
            t = ref()
            if t is None or self._taint.get(id(t), (None, -2))[1] != k:
                continue
            if not recheck or not all_finite([t]):
                return True
        return False

    # ------------------------------------------------------------------ labels

    def _label(self, t: torch.Tensor) -> int | None:
        """-1 for intended, a candidate index for tainted, None when untracked."""
        hit = self._taint.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        ref = self._intended.get(id(t))
        return -1 if ref is not None and ref() is t else None

    def _known(self, t: torch.Tensor) -> bool:
        return self._label(t) is not None

    def _mark_intended(self, outs: list[torch.Tensor]) -> None:
        for t in outs:
            if not all_finite([t]):
                self._taint.pop(id(t), None)
                self._intended[id(t)] = weakref.ref(t)


def _scalar_inf(args: Any, kwargs: Any) -> bool:
    vals = [*args, *kwargs.values()]
    return any(isinstance(v, float) and not math.isfinite(v) for v in vals)


def _requires_grad(args: Any) -> bool:
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.requires_grad:
                return True
        elif isinstance(a, (list, tuple)) and any(
                isinstance(x, torch.Tensor) and x.requires_grad for x in a):
            return True
    return False


def _param_of(names: dict[int, str], args: Any, outs: list[torch.Tensor],
              bad: torch.Tensor) -> str | None:
    """The parameter a non-finite optimizer value belongs to: by identity of the output or of
    an input at the same position of a foreach list."""
    if id(bad) in names:
        return names[id(bad)]
    lists = [a for a in args if isinstance(a, (list, tuple))]
    idx = next((i for lst in lists for i, x in enumerate(lst) if x is bad), None)
    if idx is None and outs:
        idx = next((i for i, x in enumerate(outs) if x is bad), None)
    if idx is not None:
        for lst in lists:
            if idx < len(lst) and isinstance(lst[idx], torch.Tensor) and id(lst[idx]) in names:
                return names[id(lst[idx])]
    for a in args:
        if isinstance(a, torch.Tensor) and id(a) in names:
            return names[id(a)]
    return None


def _named_tensors(batch: Any, key: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(key, batch)]
    if isinstance(batch, (list, tuple)):
        return [kv for i, x in enumerate(batch) for kv in _named_tensors(x, f"{key}[{i}]")]
    if isinstance(batch, dict):
        return [kv for k, x in batch.items() for kv in _named_tensors(x, f"{key}[{k!r}]")]
    return []
