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

The labels and candidates are kept in pinpoint/candidates.py; what is known of an op from its
name and schema (fills, transports, in-place targets) in pinpoint/op_kinds.py.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from nanguard.pinpoint import entered
from nanguard.pinpoint.attribution import Attribution, node_origin, user_source
from nanguard.pinpoint.candidates import INTENDED, Candidates
from nanguard.pinpoint.op_args import op_args
from nanguard.pinpoint.op_kinds import (
    ADOPT_OPS,
    ASSEMBLE_OPS,
    FILL_OPS,
    FROM_PYTHON_OPS,
    TRANSPORT_OPS,
    mutated,
    named_tensors,
    param_of,
    requires_grad,
    scalar_inf,
)
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
        self.candidates = Candidates()
        """The tracked tensors and the candidates for the origin (pinpoint/candidates.py)."""
        self._fresh: weakref.ref[torch.Tensor] | None = None
        attribution.on_optimizer.append(self.scan_state)
        attribution.on_model_input.append(self._batch_rows)

    # ------------------------------------------------------------------ public

    def seed_batch(self, batch: Any) -> None:
        """Register the batch: a non-finite element opens a `data` candidate at once."""
        for key, t in named_tensors(batch):
            if t.is_floating_point() and not all_finite([t]):
                rows = nonfinite_rows(t, t.shape[0] if t.dim() else None)
                o = Origin(phase="data", kind="input", samples=rows, batch_item=key,
                           step=self.step, rank=self.rank)
                self.candidates.open(o, [t], persists=False)
                break

    def finish(self) -> Origin | None:
        """Settle the origin at the end of the run (also called by `__exit__`)."""
        if not self.done:
            self.origin = self.candidates.final()
            self.done = True
        o = self.origin
        if (o is not None and (o.kind == "input" or o.phase == "data")
                and "file" not in (o.entered or {})):
            entered.place(o, self.candidates.tensors_of(o))
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
        self.candidates.forget_intended(t)
        o = Origin(step=self.step, rank=self.rank, phase="data",
                   module=self.attr.module(), op="aten.lift_fresh", source=source,
                   inputs=[data], kind="op", output=output_summary(t),
                   args={"dtype": str(t.dtype).replace("torch.", "")},
                   entered={"how": how, "source": source})
        self.candidates.open(o, [t])

    def scan_state(self, optimizer: torch.optim.Optimizer) -> None:
        """At the start of `optimizer.step()` (the attribution calls it; an armed re-run of a
        hand-written update too): a parameter or state tensor that is already non-finite
        (and untracked) opens a `state` candidate."""
        if self.done:
            return
        ts = [p for g in optimizer.param_groups for p in g["params"]]
        ts += [v for p in ts for v in optimizer.state.get(p, {}).values()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim()]
        ts = [t for t in ts if not self.candidates.known(t)]
        with torch.no_grad():
            sums = [t.detach().sum().float() for t in ts if t.numel()]
            if sums and all_finite([torch.stack(sums)]):
                return
        names = self.attr.param_names()
        for t in ts:
            if not all_finite([t]):
                self.candidates.open(Origin(step=self.step, rank=self.rank, phase="optimizer",
                                            kind="state", param=names.get(id(t))),
                                     [t], persists=False)

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
        attr.flush_pending()
        in_backward = torch._C._current_autograd_node() is not None
        if in_backward:
            attr.seen_backward = True
        elif (attr.optimizer is not None and getattr(attr.optimizer, "hand_written", False)
              and torch.is_grad_enabled() and requires_grad(args)):
            # A hand-written update ran under no_grad (or on `.data`); a grad-enabled op on a
            # trained tensor is the next step's forward, although no hook has ended the step
            # yet (raw tensors: no module forward marks it; the boundary is the next backward).
            attr.optimizer_post(attr.optimizer)
        if not in_backward and attr.optimizer is None and not attr.roots:
            attr.note_op(func.overloadpacket.__name__, args)  # where a scratch loss begins
        written = mutated(func)
        targets = float_tensors([args[i] for i in written if i < len(args)]) if written else []
        # What an in-place op overwrites must be checked first. Inside optimizer.step() the
        # parameters and state were scanned once at its start (`scan_state`) instead.
        pre_bad = {id(t) for t in targets if not self.candidates.known(t) and not all_finite([t])
                   } if targets and attr.optimizer is None else set()
        out = func(*args, **kwargs)
        outs = float_tensors(out) if out is not None else []
        if targets:
            outs = float_tensors([outs, targets])
        if (not in_backward and attr.optimizer is None and torch.is_grad_enabled()
                and requires_grad(args)):
            attr.defer_tag(outs, user_source())
        if all_finite(outs):
            self.candidates.overwritten(targets)
            if len(self.candidates):
                self.candidates.absorb(float_tensors([*args, *kwargs.values()]),
                                       target_ids={id(t) for t in targets})
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
            k = self.candidates.label(t)
            if k is not None:
                if k == INTENDED:
                    intended = True
                else:
                    tainted.append(k)
            elif (id(t) in pre_bad) if id(t) in target_ids else not all_finite([t]):
                if t.dim() == 0:  # a constant such as torch.tensor(-inf)
                    intended = True
                else:
                    external = True
                    ext.append(t)
        if name in ADOPT_OPS and not tainted and not external and outs:
            external, ext = True, [outs[0]]
        elif (not tainted and not external and outs[0].dim() and has_nan(outs)
              and (name in FROM_PYTHON_OPS
                   or (intended and name in TRANSPORT_OPS | ASSEMBLE_OPS))):
            # A NaN read from Python data (`torch.tensor(parsed_rows)` in a Dataset), or moved
            # or assembled (a collate's `stack`, `.float()`) out of constants that held it: no
            # op computed it, it came with the data (a `-inf` mask never holds a NaN).
            external, ext = True, [outs[0]]
        fill = name in FILL_OPS or scalar_inf(args, kwargs)
        if fill and not tainted:
            self.candidates.mark_intended(outs)
            if name in FROM_PYTHON_OPS and outs:  # `pinpoint.entered` may say it overflowed
                self._fresh = weakref.ref(outs[0])
            return
        # Written in place through a view (`x[:, c] = torch.log(x[:, c])`): the tensor it views
        # holds the value now, and later ops read that one, not the view. (A constant written
        # on purpose, `x[i] = float("nan")`, is intended: it stays with the view.)
        bases = [b for t in targets if isinstance(b := t._base, torch.Tensor)
                 and b.is_floating_point() and all(b is not o for o in outs)]
        if external:
            tainted.append(self._open_external(ext[0], outs))
        if tainted:
            self.candidates.carry(outs + bases, min(tainted))
            if name not in TRANSPORT_OPS and not fill:
                for k in sorted(set(tainted)):
                    self._confirm(k, name, outs)
                self._settle()
            return
        if intended and not has_nan(outs):
            self.candidates.mark_intended(outs)
            return
        self.candidates.open(self._describe(name, args, kwargs, ins, outs, func=func),
                   outs if intended else outs + bases)
        self._settle()

    # ------------------------------------------------------------------ candidates

    def _phase(self, name: str) -> str:
        """The attribution's phase, except that an op which only moves or assembles values
        before any forward of the step (a collate's `stack`, `.to()`, `.float()`, indexing)
        is loading the batch: `data`, not `loss`."""
        phase = self.attr.phase()
        # No-module code: the scratch forward is `forward` too (`Attribution.note_op`).
        if ((phase == "loss" or (phase == "forward" and not self.attr.roots))
                and not self.attr.seen_forward
                and name in TRANSPORT_OPS | ASSEMBLE_OPS | ADOPT_OPS):
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
            param = param_of(attr.param_names(), args, outs, bad)
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
        return self.candidates.open(o, [t], persists=False)

    def _batch_rows(self, args: Any) -> None:
        """The model's forward receives a batch that carries a value first met in a tensor
        outside the batch (a collate function reading a whole data set): `samples` become the
        rows of the batch, as everywhere else; the data set's rows are kept as `dataset_rows`."""
        for t in float_tensors(list(args)):
            k = self.candidates.label(t)
            if k is None or k < 0 or t.dim() == 0:
                continue
            origin = self.candidates[k].origin
            if origin.kind == "input" and origin.entered is None:
                origin.entered = {"how": "batch"}  # a model input: not a label
            if origin.kind == "input" and origin.dataset_rows is None:
                # Called from a module hook, outside the dispatch handler: our own ops must not
                # be seen by the checker as the training's.
                with _disable_current_modes():
                    rows = nonfinite_rows(t, t.shape[0])
                origin.dataset_rows = origin.samples
                origin.samples = rows

    def _confirm(self, k: int, name: str, outs: list[torch.Tensor]) -> None:
        c = self.candidates[k]
        if c.confirmed:
            return
        c.confirmed = True
        attr = self.attr
        phase, module = self._phase(name), attr.module()
        node = torch._C._current_autograd_node()
        if node is not None:
            module = node_origin(node)[0]
        c.origin.propagated_by = {"op": f"aten.{name}", "phase": phase, "module": module}
        j = self.candidates.absorbed_before(k)
        if j is not None:  # the absorbed forward value caused this backward NaN
            earlier = self.candidates[j]
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
        origin = self.candidates.settled()
        if origin is not None:
            self.origin, self.done = origin, True
