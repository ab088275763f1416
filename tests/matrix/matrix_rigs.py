"""The training setups of the configuration matrix (tests/matrix/test_matrix.py).

Every setup trains the same kind of tiny model for `STEPS` optimizer steps on pre-built batches,
once with nanguard (`observe`, a `replay` function, a run folder per guard) and once without, in
the plain loop the README documents, varied in one respect each (precision, accumulation,
compile, frozen parameters, several optimizers, ...). Three cases of data:

- `healthy`: random inputs, nothing goes non-finite.
- `nan_row`: at step `BAD`, input row `ROW` holds a NaN (cause `data_nonfinite`, phase `data`).
- `sqrt0`: at step `BAD`, input row `ROW` is all zeros, so the first (bias-free) layer gives an
  all-zero row and `Radius` takes `sqrt` at 0: an infinite derivative, NaN gradients in
  backward (cause `singular_gradient`, phase `backward`, module `radius`).

With gradient accumulation a step's samples are numbered over its micro-batches one after the
other (the bad row sits in the middle micro-batch), as `BatchProbe` numbers them.

A setup returns a `Result`: the guards' reports and folders, how many optimizer steps really ran
per guard, and the trained parameters (for the bitwise comparison with the unguarded run).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig
from nanguard.config import RecoverConfig

STEPS = 6
BAD = 3
ROW = 4  # in accumulation: the middle micro-batch (rows 3..5), its row 1
BATCH = 8
D_IN = 6
HIDDEN = 8
VOCAB = 16
CASES = ("healthy", "nan_row", "sqrt0")


class Radius(nn.Module):
    """The L2 norm of each row: `sqrt` at 0 for an all-zero row (infinite derivative)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.pow(2).sum(-1, keepdim=True).sqrt()


class Net(nn.Module):
    """body (bias-free) -> [tanh(h), radius(h), embedding, complex rotation] -> head.

    Args:
        lora: freeze body and head; train a rank-2 adapter added to the body's output.
        sparse: add an `nn.Embedding(sparse=True)` of a token id per sample.
        complex_: add a complex parameter (the real part of `h * rot` feeds the head).
    """

    def __init__(self, *, lora: bool = False, sparse: bool = False, complex_: bool = False
                 ) -> None:
        super().__init__()
        self.body = nn.Linear(D_IN, HIDDEN, bias=False)
        self.radius = Radius()
        width = HIDDEN + 1
        self.lora = lora
        if lora:
            self.adapter_a = nn.Linear(D_IN, 2, bias=False)
            self.adapter_b = nn.Linear(2, HIDDEN, bias=False)
        self.emb = nn.Embedding(VOCAB, 4, sparse=True) if sparse else None
        width += 4 if sparse else 0
        self.rot = nn.Parameter(torch.randn(HIDDEN, dtype=torch.complex64)) if complex_ else None
        width += HIDDEN if complex_ else 0
        self.head = nn.Linear(width, 1)
        if lora:
            self.body.requires_grad_(False)
            self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.body(x)
        if self.lora:
            h = h + self.adapter_b(self.adapter_a(x))
        feats = [torch.tanh(h), self.radius(h)]
        if self.emb is not None:
            assert ids is not None
            feats.append(self.emb(ids).to(h.dtype))
        if self.rot is not None:
            feats.append((h.to(self.rot.dtype) * self.rot).real.to(h.dtype))
        return self.head(torch.cat(feats, -1))


def make_batches(case: str, *, sparse: bool = False, seed: int = 0) -> list[tuple[Any, ...]]:
    """`STEPS` batches of (x, y) or (x, ids, y); the case's bad row at step `BAD`."""
    g = torch.Generator().manual_seed(100 + seed)
    w = torch.randn(D_IN, 1, generator=g)
    out: list[tuple[Any, ...]] = []
    for step in range(STEPS):
        x = torch.randn(BATCH, D_IN, generator=g)
        y = torch.tanh(x @ w) + 0.05 * torch.randn(BATCH, 1, generator=g)
        ids = torch.randint(0, VOCAB, (BATCH,), generator=g)
        if step == BAD and case == "nan_row":
            x[ROW, 1] = math.nan
        elif step == BAD and case == "sqrt0":
            x[ROW] = 0.0
        out.append((x, ids, y) if sparse else (x, y))
    return out


def model_dtype(model: nn.Module) -> torch.dtype:
    return next(p for p in model.parameters() if p.is_floating_point()).dtype


@dataclass
class Result:
    reports: list[Any] = field(default_factory=list)
    """The closed guards' reports (empty for the unguarded run)."""
    folders: list[Path] = field(default_factory=list)
    steps_taken: list[int] = field(default_factory=list)
    """Per guard: optimizer steps that really ran (counted by a hook of the test's own)."""
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every parameter after training, by a unique name."""
    init: dict[str, torch.Tensor] = field(default_factory=dict)
    trainable: set[str] = field(default_factory=set)
    expect_module: str = "radius"
    """Where the sqrt lives (a compiled model's `_orig_mod.` prefix may be there or not)."""
    bad_steps: list[int] = field(default_factory=list)
    """Per guard: its optimizer's steps completed before the bad batch, i.e. the `step` a
    finding about the bad batch carries (`BAD`, unless a GradScaler skipped a step before)."""
    healthy_reports: list[int] = field(default_factory=list)
    """Indices of reports that must stay healthy whatever the case (an unrelated run)."""


def _counter(opt: torch.optim.Optimizer) -> list[int]:
    n = [0]
    opt.register_step_post_hook(lambda *_: n.__setitem__(0, n[0] + 1))
    return n


def _config(policy: str = "observe") -> GuardConfig:
    """Quiet guards; `rollback` snapshots every healthy step and does not back the LR off, so a
    rolled-back run must equal the same run without the bad batch (`run(..., drop_bad=True)`)."""
    recover = RecoverConfig(snapshot_every=1, quiet_steps=0, backoff_factor=1.0)
    return GuardConfig(policy=policy, record=RecordConfig(summary=False), recover=recover)


def _snapshot(result: Result, models: dict[str, nn.Module], init: bool) -> None:
    target = result.init if init else result.params
    for prefix, m in models.items():
        for name, p in m.named_parameters():
            key = f"{prefix}{name}"
            target[key] = p.detach().clone()
            if init and p.requires_grad:
                result.trainable.add(key)


@dataclass(frozen=True)
class Setup:
    """One row of the matrix: how the standard loop is varied."""

    name: str
    amp: str | None = None  # "bf16" | "fp16" (+ GradScaler)
    accumulate: bool = False  # micro-batches 3 + 3 + 2 per step
    compile: bool = False
    lora: bool = False
    groups: bool = False  # head and body in param groups with different LRs (head first)
    two_optimizers: bool = False  # body and head trained by two optimizers, one guard each
    scheduler: bool = False  # LambdaLR warm-up
    sparse: str | None = None  # "sgd" (one SGD) | "adam" (SparseAdam + Adam, two guards)
    complex_: bool = False
    convert: torch.dtype | None = None  # model.to(dtype) after the guard was created
    context: bool = False  # `with Guard(...) as g:` instead of close()
    cases: tuple[str, ...] = CASES
    run: Callable[..., Result] | None = None  # a loop of its own (GAN, several runs)


def _autocast(setup: Setup) -> contextlib.AbstractContextManager[Any]:
    if setup.amp == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if setup.amp == "fp16":
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def _optimizers(setup: Setup, model: Net) -> list[torch.optim.Optimizer]:
    if setup.two_optimizers:
        return [torch.optim.SGD(model.body.parameters(), lr=0.05, momentum=0.9),
                torch.optim.Adam(model.head.parameters(), lr=1e-2)]
    if setup.sparse == "adam":
        assert model.emb is not None
        dense = [p for n, p in model.named_parameters() if not n.startswith("emb.")]
        return [torch.optim.SparseAdam(model.emb.parameters(), lr=1e-2),
                torch.optim.Adam(dense, lr=1e-2)]
    if setup.groups:
        return [torch.optim.SGD([{"params": model.head.parameters(), "lr": 0.1},
                                 {"params": model.body.parameters(), "lr": 0.01}],
                                lr=0.05, momentum=0.9)]
    if setup.lora:
        return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)]
    if setup.sparse == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)]
    return [torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)]


def run_standard(setup: Setup, case: str, folder: Path | None, policy: str = "observe",
                 drop_bad: bool = False) -> Result:
    """The README loop, varied as `setup` says; guarded when `folder` is given; without the
    bad batch (`BAD`) when `drop_bad`."""
    torch.manual_seed(0)
    net = Net(lora=setup.lora, sparse=setup.sparse is not None, complex_=setup.complex_)
    model: nn.Module = torch.compile(net) if setup.compile else net
    opts = _optimizers(setup, net)
    counters = [_counter(o) for o in opts]
    scaler = torch.amp.GradScaler("cpu") if setup.amp == "fp16" else None
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: min(1.0, (s + 1) / 4))
              for o in opts] if setup.scheduler else [None] * len(opts)
    result = Result()
    _snapshot(result, {"": net}, init=True)

    def loss_of(batch: tuple[Any, ...]) -> torch.Tensor:
        x, y = batch[0], batch[-1]
        dt = model_dtype(net)
        with _autocast(setup):
            out = model(x.to(dt), batch[1]) if setup.sparse else model(x.to(dt))
        return nn.functional.mse_loss(out.float(), y.float())

    guards: list[Any] = []
    stack = contextlib.ExitStack()
    if folder is not None:
        for k, (o, s) in enumerate(zip(opts, scheds, strict=True)):
            g = nanguard.Guard(model, o, out=folder / f"guard{k}", replay=loss_of, scheduler=s,
                               scaler=scaler, config=_config(policy))
            guards.append(stack.enter_context(g) if setup.context else g)
    if setup.convert is not None:
        net.to(setup.convert)
    with stack:
        for i, batch in enumerate(make_batches(case, sparse=setup.sparse is not None)):
            if i == BAD:
                result.bad_steps = [c[0] for c in counters]
                if drop_bad:
                    continue
            if setup.accumulate:
                n = batch[0].shape[0]
                micro = [tuple(t[a:b] for t in batch) for a, b in ((0, 3), (3, 6), (6, n))]
            else:
                micro = [batch]
            for o in opts:
                o.zero_grad()
            for mb in micro:
                loss = loss_of(mb) * (mb[0].shape[0] / BATCH)
                for g in guards:
                    g.watch(loss=loss, batch=mb)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            for o in opts:
                if scaler is not None:
                    scaler.step(o)
                else:
                    o.step()
            if scaler is not None:
                scaler.update()
            for s in scheds:
                if s is not None:
                    s.step()
        if not setup.context:
            for g in guards:
                g.close()
    result.reports = [g.report for g in guards]
    result.folders = [g.folder for g in guards]
    result.steps_taken = [c[0] for c in counters] if guards else []
    _snapshot(result, {"": net}, init=False)
    return result


# ---------------------------------------------------------------------------- GAN


class Generator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, D_IN))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def run_gan(setup: Setup, case: str, folder: Path | None, policy: str = "observe") -> Result:
    """Two models, two optimizers, two guards. The discriminator (a `Net`: its `radius` holds
    the sqrt) sees the real rows, so the bad row is the discriminator's finding."""
    torch.manual_seed(0)
    disc, gen = Net(), Generator()
    d_opt = torch.optim.Adam(disc.parameters(), lr=1e-2, betas=(0.5, 0.999))
    g_opt = torch.optim.Adam(gen.parameters(), lr=1e-2, betas=(0.5, 0.999))
    counters = [_counter(d_opt), _counter(g_opt)]
    result = Result()
    _snapshot(result, {"D.": disc, "G.": gen}, init=True)
    bce = nn.functional.binary_cross_entropy_with_logits
    zg = torch.Generator().manual_seed(7)
    batches = [(x, torch.randn(BATCH, 4, generator=zg)) for x, _ in make_batches(case)]

    def d_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        real, z = batch
        fake = gen(z).detach()
        return (bce(disc(real), torch.ones(len(real), 1))
                + bce(disc(fake), torch.zeros(len(fake), 1)))

    def g_loss(z: torch.Tensor) -> torch.Tensor:
        return bce(disc(gen(z)), torch.ones(len(z), 1))

    guards = []
    if folder is not None:
        guards = [nanguard.Guard(disc, d_opt, out=folder / "D", replay=d_loss,
                                 config=_config(policy)),
                  nanguard.Guard(gen, g_opt, out=folder / "G", replay=g_loss,
                                 config=_config(policy))]
    for i, (real, z) in enumerate(batches):
        if i == BAD:
            result.bad_steps = [c[0] for c in counters]
        loss = d_loss((real, z))
        if guards:
            guards[0].watch(loss=loss, batch=(real, z))
        d_opt.zero_grad()
        loss.backward()
        d_opt.step()
        loss = g_loss(z)
        if guards:
            guards[1].watch(loss=loss, batch=z)
        g_opt.zero_grad()
        loss.backward()
        g_opt.step()
    for g in guards:
        g.close()
    result.reports = [g.report for g in guards]
    result.folders = [g.folder for g in guards]
    result.steps_taken = [c[0] for c in counters] if guards else []
    _snapshot(result, {"D.": disc, "G.": gen}, init=False)
    return result


# ---------------------------------------------------------------------------- several guards


def run_several(setup: Setup, case: str, folder: Path | None, policy: str = "observe"
                ) -> Result:
    """Two independent runs in one process, interleaved step by step, each with its own guard
    in the default folder (`nanguard_runs/<time>` under the working directory, which the test
    sets to a temporary folder), both created within the same second. Only run A gets the
    case's bad row; run B must stay healthy and keep its own record."""
    torch.manual_seed(0)
    nets = [Net(), Net()]
    opts = [torch.optim.SGD(n.parameters(), lr=0.05, momentum=0.9) for n in nets]
    counters = [_counter(o) for o in opts]
    result = Result(healthy_reports=[1])
    _snapshot(result, {"A.": nets[0], "B.": nets[1]}, init=True)
    data = [make_batches(case), make_batches("healthy", seed=1)]

    def loss_fn(net: nn.Module) -> Callable[[Any], torch.Tensor]:
        return lambda b: nn.functional.mse_loss(net(b[0]), b[1])

    guards = []
    if folder is not None:
        guards = [nanguard.Guard(n, o, replay=loss_fn(n), config=_config(policy))
                  for n, o in zip(nets, opts, strict=True)]
    for step in range(STEPS):
        if step == BAD:
            result.bad_steps = [c[0] for c in counters]
        for k in range(2):
            batch = data[k][step]
            loss = loss_fn(nets[k])(batch)
            if guards:
                guards[k].watch(loss=loss, batch=batch)
            opts[k].zero_grad()
            loss.backward()
            opts[k].step()
    for g in guards:
        g.close()
    result.reports = [g.report for g in guards]
    result.folders = [g.folder for g in guards]
    result.steps_taken = [c[0] for c in counters] if guards else []
    _snapshot(result, {"A.": nets[0], "B.": nets[1]}, init=False)
    return result


SETUPS = [
    Setup("fp32"),
    Setup("bf16_autocast", amp="bf16"),
    Setup("fp16_autocast_scaler", amp="fp16"),
    Setup("grad_accumulation", accumulate=True),
    Setup("compiled", compile=True),
    Setup("frozen_lora", lora=True),
    Setup("param_groups", groups=True),
    Setup("two_optimizers_one_model", two_optimizers=True),
    Setup("gan_two_models", run=run_gan),
    Setup("lr_warmup_scheduler", scheduler=True),
    Setup("sparse_embedding_sgd", sparse="sgd"),
    Setup("sparse_embedding_sparseadam", sparse="adam"),
    Setup("complex_params", complex_=True),
    Setup("converted_float64_after_guard", convert=torch.float64),
    Setup("converted_bfloat16_after_guard", convert=torch.bfloat16),
    Setup("context_manager", context=True),
    Setup("several_guards", run=run_several),
]


def run(setup: Setup, case: str, folder: Path | None, policy: str = "observe") -> Result:
    return (setup.run or run_standard)(setup, case, folder, policy)


def run_without_bad(setup: Setup, case: str) -> Result | None:
    """The unguarded run that never saw the bad batch: what a rollback to the state before it
    (snapshot every step, no LR backoff) must end equal to. None where no such run exists: two
    models (the other model still learns in the bad step), a GradScaler (it skipped the bad
    step itself and backed its scale off)."""
    if setup.run is not None or setup.amp == "fp16":
        return None
    return run_standard(setup, case, None, drop_bad=True)
