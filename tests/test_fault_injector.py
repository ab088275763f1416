"""`nanguard.testing.FaultInjector` on a real tiny training loop under a Guard: the highest
exponent bit of a parameter flipped at step k makes the loss jump at k+1 and the guard alarm
there; of a gradient, the guard alarms at k; of an activation, the loss jumps at k itself; the
sign of Adam's second moment poisons the next update; the lowest mantissa bit is harmless.
The element is chosen by the seed, what was flipped is recorded, the hooks go away."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from nanguard import Guard
from nanguard.testing import FaultInjector, Flip, flip_bit, mantissa_bits, top_exponent_bit

K = 12  # the step of every flip: past the first steps, well before the end
STEPS = 16


def _train(tmp_path, plan=None, *, adam: bool = False, seed: int = 1):
    """Train a small MLP for STEPS steps under a Guard (policy observe); `plan(injector)`
    plans the flips. Returns (losses, the alarms as (step, kind), the planned flips)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-2) if adam
           else torch.optim.SGD(model.parameters(), lr=0.05))  # fmt: skip
    x = torch.randn(256, 8)
    y = x.sum(1, keepdim=True)
    guard = Guard(model, opt, out=tmp_path / f"run{len(list(tmp_path.iterdir()))}")
    losses = []
    with FaultInjector(model, opt, seed=seed) as inj:
        flips = plan(inj) if plan else []
        for step in range(STEPS):
            i = (step * 32) % 256
            loss = nn.functional.mse_loss(model(x[i : i + 32]), y[i : i + 32])
            guard.watch(loss=loss)
            losses.append(loss.item())
            opt.zero_grad()
            loss.backward()
            opt.step()
    guard.close()
    return losses, [(a.step, a.kind) for a in guard.alarms], flips


def _jumped(before: float, after: float) -> bool:
    return not math.isfinite(after) or after > 1e6 * before


def test_high_exponent_bit_of_a_parameter(tmp_path):
    bit = top_exponent_bit(torch.float32)
    losses, alarms, [flip] = _train(
        tmp_path, lambda inj: [inj.flip_param("0.weight", step=K, bit=bit)]
    )
    assert flip.fired and flip.index is not None
    assert abs(flip.new / flip.old) == 2.0**128  # |x| < 2: the exponent gains 128
    assert not _jumped(losses[K - 1], losses[K])  # step K's forward ran before the flip
    assert _jumped(losses[K], losses[K + 1])
    assert alarms and min(s for s, _ in alarms) == K + 1


def test_high_exponent_bit_of_a_gradient(tmp_path):
    losses, alarms, [flip] = _train(
        tmp_path, lambda inj: [inj.flip_grad("2.weight", step=K, bit=30)]
    )
    assert flip.fired and abs(flip.new) > 1e30
    # The guard reads the flipped gradient before step K's update: it alarms at K...
    assert (K, "spike") in alarms or (K, "overflow") in alarms, alarms
    assert min(s for s, _ in alarms) == K
    assert _jumped(losses[K], losses[K + 1])  # ...and the update it fed breaks step K+1


def test_high_exponent_bit_of_an_activation(tmp_path):
    losses, alarms, [flip] = _train(
        tmp_path, lambda inj: [inj.flip_activation("0", step=K, bit=30)]
    )
    assert flip.fired and len(flip.index) == 2  # (sample, feature) of the Linear's output
    assert _jumped(losses[K - 1], losses[K])  # the forward of step K itself
    assert min(s for s, _ in alarms) == K


def test_sign_of_adam_second_moment(tmp_path):
    losses, alarms, [flip] = _train(
        tmp_path,
        lambda inj: [inj.flip_optimizer_state("0.weight", "exp_avg_sq", step=K, bit=31)],
        adam=True,
    )
    assert flip.fired and flip.old > 0 and flip.new == -flip.old
    assert all(math.isfinite(v) for v in losses[: K + 1])
    assert (K + 1, "nonfinite") in alarms  # sqrt of a negative moment in step K+1's update


@pytest.mark.parametrize("target", ["param", "grad", "activation"])
def test_lowest_mantissa_bit_is_harmless(tmp_path, target):
    clean, _, _ = _train(tmp_path)

    def plan(inj: FaultInjector) -> list[Flip]:
        if target == "activation":
            return [inj.flip_activation("0", step=K, bit=0)]
        return [getattr(inj, f"flip_{target}")("0.weight", step=K, bit=0)]

    losses, alarms, [flip] = _train(tmp_path, plan)
    assert flip.fired and flip.new != flip.old
    assert abs(flip.new - flip.old) <= 2.0 ** -mantissa_bits(torch.float32) * abs(flip.old)
    assert alarms == []
    assert losses == pytest.approx(clean, rel=1e-4)


def test_seeded_element_and_hooks_removed(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def picks(seed: int) -> tuple[int, ...] | None:
        with FaultInjector(model, opt, seed=seed) as inj:
            flip = inj.flip_param("0.weight", step=0, bit=0)
            later = inj.flip_param("0.weight", step=99, bit=30)
            opt.step()
        flip_bit(model[0].weight, flip.index, 0)  # undo: the next pick starts from the same
        assert not later.fired and later.old is None
        return flip.index

    assert picks(1) == picks(1) and picks(1) != picks(2)
    late = []
    for bit in (0, 30):
        with FaultInjector(model, opt, seed=1, step=40) as inj:  # made mid-run: Guard's steps
            late.append(inj.flip_param("0.weight", step=40, bit=bit))
            opt.step()
        flip_bit(model[0].weight, late[-1].index, bit)  # undo
    assert all(f.fired for f in late) and late[0].index == late[1].index  # whatever the bit
    assert not opt._optimizer_step_post_hooks and not model[0]._forward_hooks
    with pytest.raises(ValueError, match="no parameter"):
        FaultInjector(model, opt).flip_param("nope", step=0, bit=0)
    with FaultInjector(model, opt) as inj:  # another rank's flip never fires on this one
        other = inj.flip_param("0.weight", step=inj.step, bit=30, rank=1)
        opt.step()
    assert not other.fired


def test_flip_bit_primitive():
    t = torch.tensor([1.0, 0.5])
    assert flip_bit(t, (0,), 31) == (1.0, -1.0)
    assert flip_bit(t, (1,), 0)[1] == 0.5 + 2.0**-24
    assert flip_bit(torch.tensor([1.0], dtype=torch.bfloat16), (0,), 14)[1] == math.inf
    assert top_exponent_bit(torch.float16) == 14 and top_exponent_bit(torch.float64) == 62
    with pytest.raises(ValueError, match="bit 32"):
        flip_bit(t, (0,), 32)


def test_activation_of_a_module_returning_a_tuple():
    torch.manual_seed(0)
    lstm = nn.LSTM(4, 8, batch_first=True)
    opt = torch.optim.SGD(lstm.parameters(), lr=0.1)
    x = torch.randn(2, 3, 4)
    clean, (h, _) = lstm(x)
    with FaultInjector(lstm, opt) as inj:
        flip = inj.flip_activation("", step=0, bit=30)  # "" is the root module
        out, (h2, _) = lstm(x)
        out.sum().backward()  # autograd passes through the flipped copy
    assert flip.fired and out[flip.index].item() == flip.new and clean[flip.index] == flip.old
    assert torch.equal(h, h2)  # the states, after the output in the tuple, are untouched
    assert (out != clean).sum() == 1
