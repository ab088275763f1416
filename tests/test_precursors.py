"""What preceded each loss spike: Adam's moments and the largest |attention logit| (issue 30).

A tiny GPT with both attention paths (`F.scaled_dot_product_attention` in one block, nanoGPT's
hand-written `q @ k^T * scale; masked_fill(-inf); softmax` in the other) trains under a Guard
with activations watched. Expected values are computed here, independently: the attention
logits from the blocks' own weights and inputs (float64, the causal mask by index), the moment
norms from the optimizer's state, the baselines with numpy.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig
from nanguard.config import WatchConfig
from nanguard.record.spikes import SpikeMeter
from nanguard.watch import attention

T, V, D, H = 8, 16, 16, 2


class SdpaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.qscale = 1.0  # a planted logit growth multiplies q

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
        return q * self.qscale, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(x.shape))


class ManualBlock(SdpaBlock):
    """nanoGPT's path without flash attention."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)
        t = x.shape[1]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(x.shape))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.zeros(T, D))
        self.blocks = nn.Sequential(SdpaBlock(), ManualBlock())
        self.head = nn.Linear(D, V)
        self.temp = 1.0  # a planted loss spike sharpens the logits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(tokens) + self.pos)) * self.temp


def expected_logit_max(block: SdpaBlock, x: torch.Tensor) -> float:
    """Largest |q k^T / sqrt(d_head)| over causal entries, from the block's weights (float64)."""
    with torch.no_grad():
        ln = block.ln
        h = F.layer_norm(x.double(), (D,), ln.weight.double(), ln.bias.double(), ln.eps)
        qkv = h @ block.qkv.weight.double().T + block.qkv.bias.double()
        b, t, _ = x.shape
        q, k, _ = qkv.view(b, t, 3, H, D // H).unbind(2)
        s = torch.einsum("bihd,bjhd->bhij", q * block.qscale, k) / math.sqrt(D // H)
        i, j = torch.meshgrid(torch.arange(t), torch.arange(t), indexing="ij")
        return float(s[..., i >= j].abs().max())


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, V, (steps, 4, T + 1), generator=g)
    return [(s[:, :-1], (s[:, :-1] + 1) % V) for s in seq]  # learn "next = this + 1"


def train(out: Path | None, steps: int, *, watch: WatchConfig | None = None,
          plant: Callable[[int, TinyGPT], float] | None = None,
          inside: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Adam on TinyGPT; per step the expected attention max and moment norms, taken here.
    `plant(step, model)` may change the model before the forward and returns a factor for the
    backward's loss; `inside(step)` runs inside the model's forward (what is armed there)."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    logits: dict[int, float] = {}
    rec: dict[str, list[float]] = {"attn": [], "m1": [], "m2": []}

    def seen(block: nn.Module, args: tuple[torch.Tensor]) -> None:
        if torch.is_grad_enabled():
            logits[id(block)] = expected_logit_max(block, args[0])
            if inside is not None:
                inside(step)

    for blk in model.blocks:
        blk.register_forward_pre_hook(seen)
    guard = None
    if out is not None:
        guard = nanguard.Guard(model, opt, config=GuardConfig(
            # The moments every step (`sample_every=1`): their values are compared step by
            # step here; sampled, they are what `sample_every` steps give.
            watch=watch or WatchConfig(activations=True, sample_every=1),
            record=RecordConfig(out=str(out), summary=False)))
    for step, (x, y) in enumerate(data(steps)):
        factor = plant(step, model) if plant else 1.0
        logits.clear()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        if guard is not None:
            guard.watch(loss=loss)
        opt.zero_grad()
        (loss * factor).backward()
        opt.step()
        rec["attn"].append(max(logits.values()))
        state = [opt.state[p] for p in model.parameters()]
        rec["m1"].append(math.sqrt(sum(float(s["exp_avg"].double().pow(2).sum()) for s in state)))
        rec["m2"].append(math.sqrt(sum(float(s["exp_avg_sq"].double().pow(2).sum())
                                       for s in state)))
        model.temp, model.blocks[0].qscale = 1.0, 1.0
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    if guard is not None:
        guard.close()
    return {"weights": weights, **rec}


def column(out: Path, name: str) -> list[float | None]:
    db = sqlite3.connect(out / "run.db")
    try:
        rows = db.execute(f"SELECT {name} FROM steps ORDER BY step").fetchall()
    finally:
        db.close()
    return [None if r[0] is None else float(r[0]) for r in rows]


def test_attention_logits_and_moments_equal_values_computed_from_the_weights(
        tmp_path: Path) -> None:
    got = train(tmp_path, 6)
    attn = column(tmp_path, "attn_logit_max")
    assert all(a is not None for a in attn)
    np.testing.assert_allclose(attn, got["attn"], rtol=1e-5)
    np.testing.assert_allclose(column(tmp_path, "momentum_norm"), got["m1"], rtol=1e-5)
    np.testing.assert_allclose(column(tmp_path, "second_moment_norm"), got["m2"], rtol=1e-5)


def test_observing_attention_never_changes_training(tmp_path: Path) -> None:
    plain = train(None, 8)["weights"]
    watched = train(tmp_path, 8)["weights"]
    assert torch.equal(plain, watched)


def test_no_mode_and_no_hook_on_a_step_that_is_not_sampled(tmp_path: Path) -> None:
    stack: dict[int, int] = {}

    def inside(step: int) -> None:  # inside the model's forward
        stack[step] = torch._C._len_torch_function_stack()

    train(tmp_path, 6, watch=WatchConfig(activations=True, activations_every=3), inside=inside)
    assert stack == {0: 1, 1: 0, 2: 0, 3: 1, 4: 0, 5: 0}
    attn = column(tmp_path, "attn_logit_max")
    assert [a is not None for a in attn] == [True, False, False, True, False, False]


def test_a_model_without_attention_records_none(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with nanguard.Guard(model, opt, config=GuardConfig(
            watch=WatchConfig(activations=True, sample_every=1),
            record=RecordConfig(out=str(tmp_path), summary=False))):
        for _ in range(5):
            x = torch.randn(16, 4)
            # a classifier's softmax (2-d) is not attention
            loss = -torch.log(F.softmax(model(x), dim=-1)[:, 0]).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert column(tmp_path, "attn_logit_max") == [None] * 5
    assert all(v is not None for v in column(tmp_path, "second_moment_norm"))
    m = json.loads((tmp_path / "report.json").read_text())["spike_measures"]
    assert m["measured"]["attn_logit_max"] == 0 and m["measured"]["second_moment_norm"] == 5


def test_planted_moment_and_logit_growth_before_a_loss_spike(tmp_path: Path) -> None:
    jump = 40

    def plant(step: int, model: TinyGPT) -> float:
        if step == jump - 1:
            model.blocks[0].qscale = 6.0  # the logits grow one step before
        if step == jump:
            model.temp = -20.0  # the loss spike: confidently wrong
        return 30.0 if step == jump - 3 else 1.0  # a 30x gradient three steps before

    got = train(tmp_path, jump + 3, plant=plant)
    ep = json.loads((tmp_path / "report.json").read_text())["spike_measures"]["episodes"][0]
    assert ep["start"] == jump
    for key, name, k in (("m2", "second_moment_norm", 3), ("attn", "attn_logit_max", 1)):
        # the planted step's value over the mean of every value before it (numpy, here)
        ratios = {s: got[key][s] / np.mean(got[key][:s]) for s in range(jump - 3, jump)}
        assert max(ratios, key=lambda s: ratios[s]) == jump - k
        b = ep["before"][name]
        assert b["steps_before"] == k
        assert b["ratio"] == pytest.approx(ratios[jump - k], rel=1e-5)
        assert b["ratio"] > 3
    assert ep["before"]["momentum_norm"]["steps_before"] == 3


def test_sdpa_logits_with_masks_gqa_and_blocks_equal_a_direct_computation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 5, 8, generator=g) * 3
    k = torch.randn(2, 2, 7, 8, generator=g) * 3
    keep = torch.rand(2, 1, 5, 7, generator=g) > 0.4
    bias = torch.randn(5, 7, generator=g)
    bias[0, 3] = -math.inf
    kk = k.repeat_interleave(2, dim=1)
    s = q @ kk.transpose(-2, -1) * 0.3
    causal = torch.ones(5, 7, dtype=torch.bool).tril()
    monkeypatch.setattr(attention, "BLOCK", 2 * 4 * 7 * 2)  # two query rows at a time
    for mask, cause, want in (
            (keep, False, s[keep.expand_as(s)].abs().max()),
            (bias, True, (s + bias)[causal.expand_as(s) & (bias > -1e3)].abs().max()),
            (None, True, s[causal.expand_as(s)].abs().max())):
        got = attention.sdpa_logits_absmax(q, k, mask, cause, 0.3, enable_gqa=True)
        assert float(got) == pytest.approx(float(want), rel=1e-6)
    nan_q = q.clone()
    nan_q[1, 2, 3, 0] = math.nan
    assert math.isnan(float(attention.sdpa_logits_absmax(nan_q, k, enable_gqa=True)))


def test_before_lists_the_new_precursors_from_hand_computed_series() -> None:
    meter = SpikeMeter()
    for step in range(30):
        values = {"loss": 1.0 + 0.01 * (step % 3), "second_moment_norm": 2.0,
                  "attn_logit_max": None if 10 <= step < 15 else 5.0}  # not sampled: 10-14
        if step == 26:
            values["second_moment_norm"] = 9.0
        if step == 27:
            values["attn_logit_max"] = 20.0
        if step == 29:
            values["loss"] = 5.0
        meter.update(step, values)
    (ep,) = meter.summary()["episodes"]
    assert ep["start"] == 29
    m2 = ep["before"]["second_moment_norm"]
    # 9 over 26 values of 2 before it; the smallest: 2 over (26 x 2 + 9) / 27 at step 27
    assert {k: m2[k] for k in ("ratio", "steps_before", "value", "baseline")} == {
        "ratio": 4.5, "steps_before": 3, "value": 9.0, "baseline": 2.0}
    assert m2["min_ratio"] == pytest.approx(2 / (61 / 27), rel=1e-12)
    assert ep["before"]["attn_logit_max"]["ratio"] == 4.0
    assert ep["before"]["attn_logit_max"]["steps_before"] == 2
    assert meter.summary()["measured"]["attn_logit_max"] == 25


def test_an_error_of_the_probe_turns_it_off_and_training_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: Any, **__: Any) -> torch.Tensor:
        raise RuntimeError("planted")

    monkeypatch.setattr(attention, "sdpa_logits_absmax", broken)
    plain = train(None, 4)["weights"]
    watched = train(tmp_path, 4)["weights"]
    assert torch.equal(plain, watched)
    # none recorded: not even step 0's manual block alone (a max over part of the calls)
    assert column(tmp_path, "attn_logit_max") == [None] * 4


@pytest.mark.bench  # a benchmark's smoke test: CI runs it (-m bench)
def test_attention_cost_benchmark_runs(tmp_path: Path) -> None:
    """benchmarks/attention_cost.py end to end, one block per configuration (no timing
    asserted: the output's shape, and no run folder left behind)."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "attention_cost.py"),
                           "--steps", "10", "--block", "10"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["steps"] == 10 and set(out["ms_per_step"]) == {"plain", "act", "attn", "attn10"}
    assert out["attn_vs_act"] > 0 and not list(tmp_path.iterdir())
