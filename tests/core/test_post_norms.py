"""The post-update norms (parameters, every optimizer-state key, buffers) travel in one packet
slot and decode back to the right signals, checked against norms computed independently; a
custom optimizer whose state keys are called `update` and `param` is not taken for the update
norm or the parameters."""

from __future__ import annotations

import torch
from torch import nn

from nanguard import Guard, GuardConfig, RecordConfig, WatchConfig


class OddNamesSGD(torch.optim.Optimizer):
    """SGD with momentum that keeps its buffer under the key `update` and a copy of the last
    parameter value under `param` (names a real custom optimizer may well use)."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("update", torch.zeros_like(p))
                buf.mul_(0.9).add_(p.grad)
                state["param"] = p.detach().clone()
                p.add_(buf, alpha=-group["lr"])


def test_post_norms_decode_to_the_right_signals() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    opt = OddNamesSGD(model.parameters())
    config = GuardConfig(record=RecordConfig(summary=False),
                         watch=WatchConfig(update_ratio_every=2, sample_every=1))
    guard = Guard(model, opt, out="", config=config)
    x, y = torch.randn(16, 6), torch.randn(16, 1)
    params = list(model.parameters())
    for step in range(4):
        before = [p.detach().clone() for p in params]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stats = guard.history[-1]
        assert stats.step == step
        want_param = {i: float(torch.linalg.vector_norm(p.detach())) for i, p in enumerate(params)}
        want_update = {i: float(torch.linalg.vector_norm(opt.state[p]["update"]))
                       for i, p in enumerate(params)}
        want_copy = {i: float(torch.linalg.vector_norm(opt.state[p]["param"]))
                     for i, p in enumerate(params)}
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        want_buffer = {i: float(torch.linalg.vector_norm(b)) for i, b in enumerate(buffers)}
        torch.testing.assert_close(stats.param_norms, want_param, rtol=1e-6, atol=0)
        torch.testing.assert_close(stats.state_norms["update"], want_update, rtol=1e-6, atol=0)
        torch.testing.assert_close(stats.state_norms["param"], want_copy, rtol=1e-6, atol=0)
        torch.testing.assert_close(stats.buffer_norms, want_buffer, rtol=1e-6, atol=0)
        if step % 2 == 0:  # sampled: the norm of the whole update, not the state key `update`
            moved = torch.sqrt(sum(((p.detach() - b) ** 2).sum() for p, b in
                                    zip(params, before, strict=True)))
            assert stats.update_norm is not None
            assert abs(stats.update_norm - float(moved)) <= 1e-5 * float(moved)
        else:
            assert stats.update_norm is None
    guard.close()
