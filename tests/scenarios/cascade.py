"""The LR/momentum cascade (`nanguard.scenarios.cascade`, seed 24): a gradient spike, then
momentum and growing weights feed each other until a Linear layer overflows float32 in the
forward of the failing step. Run as a whole script under `armed(step)` (zero-code mode) or,
via `build()`, as the failing step after training up to it."""

import math
from typing import Any

import torch

from nanguard.scenarios.cascade import make_cascade, train_cascade

from . import Built

SEED = 24
EXPECTED = {"phase": "forward", "module": "2", "op": "aten.addmm", "samples": None,
            "cause": "optimizer_divergence"}


def first_nonfinite_step(seed: int = SEED, steps: int = 60) -> int:
    """The step whose loss is non-finite, or whose update leaves a non-finite parameter."""
    setup = make_cascade(seed, steps=steps)
    for i, (x, y) in enumerate(setup.batches):
        loss = setup.loss_fn(setup.model(x), y)
        setup.optimizer.zero_grad()
        loss.backward()
        setup.optimizer.step()
        params_ok = all(bool(p.isfinite().all()) for p in setup.model.parameters())
        if not math.isfinite(loss.item()) or not params_ok:
            return i
    raise AssertionError(f"seed {seed} did not fail within {steps} steps")


def run_script(seed: int = SEED, steps: int = 60) -> Any:
    """The unchanged training script (what `nanguard run` would re-run)."""
    return train_cascade(seed, steps=steps)


def build() -> Built:
    n = first_nonfinite_step()
    setup = make_cascade(SEED, steps=n + 1)
    batches = list(setup.batches)
    model, opt = setup.model, setup.optimizer
    for x, y in batches[:n]:
        loss = setup.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = batches[n]

    def step() -> torch.Tensor:
        loss = setup.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    return Built(model=model, optimizer=opt, batch=(x, y), step=step, notes={"step": n})
