"""The hot path reads the device at most once per step (DESIGN.md sections 2 and 4).

Every way a tensor reaches the host (`item`, `tolist`, `numpy`, `__bool__`, `__float__`,
`__int__`, `__index__`, `__array__`, `cpu`) is counted while `optimizer.step()` runs, when the
call comes from nanguard's code (the optimizer's own reads, e.g. Adam's step counter, are not
ours; the user's `loss.item()` is outside the step). Default mode: one read per step; with
`WatchConfig(read_every=4)`: one per 4 steps.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import nanguard
from helpers import make_mlp, make_optimizer, warmup_cosine
from nanguard import Guard
from nanguard.watch.step import StepWatch

NANGUARD_DIR = str(Path(nanguard.__file__).resolve().parent)
READS = (
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__array__",
    "cpu",
)


class ReadCounter:
    """Counts host reads made from nanguard's code on the training thread while `active`.

    The guard's one read (`StepWatch.read`, or the quiet lane's own) counts once, by the
    guard's `host_reads`: on the CPU it takes the step's values one by one (host memory
    already, no device to wait for; on CUDA it reads one tensor, tests/perf/test_gpu_no_sync.py).
    Any other read from nanguard's code counts on its own."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active = False
        self.thread = threading.get_ident()  # the training thread (the test's)
        self.calls: list[str] = []
        self._inside_read = False
        for name in READS:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(name, original))
        original_read = StepWatch.read

        def read(watch, t):  # counted by `host_reads`; the reads inside it are that one
            self._inside_read = True
            try:
                return original_read(watch, t)
            finally:
                self._inside_read = False

        monkeypatch.setattr(StepWatch, "read", read)

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            # The training thread's reads only: the run store's writer thread combines the
            # steps' fingerprint sums off the step (that is where they belong), at times of
            # its own; counting them made this test fail at random.
            if (self.active and not self._inside_read
                    and threading.get_ident() == self.thread and _called_from_nanguard()):
                self.calls.append(name)
            return original(tensor, *args, **kwargs)

        return counted


def _called_from_nanguard() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if str(Path(frame.f_code.co_filename).resolve()).startswith(NANGUARD_DIR):
            return True
        frame = frame.f_back
    return False


def _train_counting(counter: ReadCounter, guard: Guard, task, optimizer, steps: int) -> list[int]:
    """Reads per step, counted inside `optimizer.step()` only."""
    per_step = []
    scheduler = warmup_cosine(optimizer, steps, 5)
    for x, y in task.batches(steps):
        loss = task.loss_fn(task.model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        optimizer.zero_grad()
        loss.backward()
        counter.calls.clear()
        reads = guard.host_reads
        counter.active = True
        optimizer.step()
        counter.active = False
        per_step.append(guard.host_reads - reads + len(counter.calls))
        scheduler.step()
        loss.item()  # the user's own read: not ours, and not counted
    return per_step


@pytest.mark.parametrize(("kind", "activations"), [("adam", False), ("sgd", True)])
def test_one_read_per_step(kind, activations, monkeypatch, quiet_config):
    task = make_mlp(1)
    optimizer = make_optimizer(kind, task.model, 1e-3)
    counter = ReadCounter(monkeypatch)
    guard = Guard(task.model, optimizer, config=quiet_config(out="", activations=activations))
    per_step = _train_counting(counter, guard, task, optimizer, 40)
    guard.close()
    assert per_step == [1] * 40, per_step
    # ... and one at close: the optimizer state after the last step, which did not sample it
    # (`watch.sampling`).
    assert guard.host_reads == 41
    assert guard.history[-1].grad_norm > 0  # the one read carried the statistics


def test_read_every_four_steps(monkeypatch, tmp_path, quiet_config):
    task = make_mlp(1)
    optimizer = make_optimizer("adam", task.model, 1e-3)
    counter = ReadCounter(monkeypatch)
    config = quiet_config(out=str(tmp_path), read_every=4, activations=True)
    guard = Guard(task.model, optimizer, config=config)
    per_step = _train_counting(counter, guard, task, optimizer, 40)
    guard.close()
    assert per_step == [0, 0, 0, 1] * 10, per_step
    assert guard.history[-1].step == 39 and len(guard.history) == 40


def test_the_counter_sees_reads(monkeypatch):
    """The counter is not blind: a read from nanguard's code is counted, the test's own not."""
    counter = ReadCounter(monkeypatch)
    counter.active = True
    torch.ones(2).tolist()
    assert counter.calls == []
    from nanguard.watch.probe import StepProbe

    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), float("inf"))
    probe = StepProbe([p], torch.optim.SGD([p], lr=0.1))
    stats = nanguard.watch.StepStats(step=0, grad_norms={0: float("inf")}, nonfinite_grads={0})
    probe.resolve_overflow(stats)  # the rare extra read, only on an infinite norm
    assert counter.calls, "a read from nanguard's code went uncounted"
