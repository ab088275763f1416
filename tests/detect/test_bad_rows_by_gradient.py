"""A bad batch named by its rows' gradients when its loss is no outlier (`bad_batch.by_rows`).

Seen on nanoGPT (BENCHMARKS.md "Held-out spikes on nanoGPT"): rows of one repeated symbol made
grad-norm spikes of 2-3.6x at 20 sigma; the replay named the corrupted row at z 22, but the
spike was not called a bad batch (its loss was not an outlier), and heal counts such spikes
towards an LR cut. Here a look-alike: a tiny character GRU reading windows of a text, whose
loader fills `BAD_ROWS` rows of step `K`'s batch with one repeated symbol. The truth (step and
rows) is the plant's; the script's own grad norm shows the spike and its own per-row losses
show that no row's loss is far out.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from nanguard import Guard, GuardConfig, RecordConfig

K, STEPS, BATCH, BLOCK = 70, 90, 32, 24
BAD_ROWS = [5, 26]
TEXT = ("the cat sat on the mat and the dog ran to the park while the bird sang a song of "
        "the sea and the sky over the hill where the old tree stands")


class CharGRU(nn.Module):
    """`layout`: "batch_first" (a GRU with batch_first=True), "transposed" (batch-first input,
    a sequence-first GRU: the model transposes inside), "seq_first" (the batch itself is
    `(time, batch)`, as word_language_model's)."""

    def __init__(self, layout: str = "batch_first") -> None:
        super().__init__()
        self.layout = layout
        self.emb = nn.Embedding(256, 48)
        self.rnn = nn.GRU(48, 48, batch_first=layout == "batch_first")
        self.head = nn.Linear(48, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "transposed":
            x = x.t()
        h = self.rnn(self.emb(x))[0]
        if self.layout == "transposed":
            h = h.transpose(0, 1)
        out: torch.Tensor = self.head(h)
        return out


def _batches(plant: bool, seq_first: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    words = TEXT.split()
    text = " ".join(words[i] for i in torch.randint(0, len(words), (3000,), generator=g))
    data = torch.tensor(list(text.encode()), dtype=torch.long)
    out = []
    for step in range(STEPS):
        starts = torch.randint(0, len(data) - BLOCK - 1, (BATCH,), generator=g)
        chunk = torch.stack([data[s:s + BLOCK + 1] for s in starts.tolist()])
        if plant and step == K:
            chunk[BAD_ROWS] = ord("z")  # a region of one repeated symbol
        x, y = chunk[:, :-1], chunk[:, 1:]
        out.append((x.t().contiguous(), y.t().contiguous()) if seq_first else (x, y))
    return out


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    logits = model(batch[0])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[1].reshape(-1))


def _train(tmp_path, policy: str, plant: bool = True, layout: str = "batch_first",
           clip: float | None = None) -> tuple[dict, list[float], list[float]]:
    """The run under `policy`; its report, the script's own grad norms and losses. `clip`:
    the script clips to that norm (`clip_grad_norm_`) and hands its total to the guard; its
    grad norms are then the totals the clip returned (before clipping)."""
    torch.manual_seed(0)
    model = CharGRU(layout)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = Guard(model, opt, replay=lambda b: _loss(model, b), config=GuardConfig(
        policy=policy, record=RecordConfig(out=str(tmp_path), summary=False)))
    norms: list[float] = []
    losses: list[float] = []
    for batch in _batches(plant, seq_first=layout == "seq_first"):
        loss = _loss(model, batch)
        losses.append(loss.item())
        g.watch(loss=loss, batch=batch)
        opt.zero_grad()
        loss.backward()
        if clip is None:
            norms.append(float(torch.sqrt(sum((p.grad ** 2).sum()
                                              for p in model.parameters()))))
        else:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            g.note_clip_norm(total)
            norms.append(float(total))
        opt.step()
    g.close()
    return json.loads((tmp_path / "report.json").read_text()), norms, losses


def test_repeated_symbol_rows_are_a_bad_batch_named_by_their_gradients(tmp_path) -> None:
    report, norms, losses = _train(tmp_path / "plant", "observe")
    # the premise, from the script itself: a gradient spike whose batch's loss stays ordinary
    assert norms[K] >= 3 * max(norms[K - 20:K]), norms[K - 5:K + 1]
    assert losses[K] < 1.5 * sorted(losses[K - 20:K])[10], losses[K - 5:K + 1]
    at_k = [a for a in report["alarms"] if a["step"] == K]
    assert at_k and all(a["cause"] == "bad_batch" for a in at_k), at_k
    assert "row(s) 5, 26 carry its gradient" in at_k[0]["message"]
    spike = next(s for s in report["spikes"] if s["step"] == K)
    assert spike["cause"] == "bad_batch" and spike["rows"] == BAD_ROWS
    assert spike["batch"]  # its fingerprint
    # the clean run: nothing named, nothing alarmed
    clean, _, _ = _train(tmp_path / "clean", "observe", plant=False)
    assert clean["status"] == "healthy" and not clean["alarms"], clean["alarms"]


@pytest.mark.parametrize("policy", ["heal", "skip"])
def test_heal_and_skip_answer_the_batch_and_leave_the_lr(tmp_path, policy) -> None:
    report, _, _ = _train(tmp_path, policy)
    acts = [a for a in report["actions"] if a["step"] == K]
    assert acts and "a bad batch (batch " in acts[0]["detail"], report["actions"]
    assert report["status"] == "recovered"
    if policy == "heal":
        heal = report["run"]["recovery"]["heal"]
        assert heal["bad_batches"] == [K] and heal["precursors"] == 0 and heal["cuts"] == []


def test_a_model_that_transposes_inside_keeps_its_rows(tmp_path) -> None:
    """A sequence-first GRU fed a batch-first batch it transposes: dim 0 is the sample axis,
    and a one-sample replay reaches the GRU with one sequence (`pinpoint.sample_axis`)."""
    report, _, _ = _train(tmp_path, "observe", layout="transposed")
    spike = next(s for s in report["spikes"] if s["step"] == K)
    assert spike["cause"] == "bad_batch" and spike["rows"] == BAD_ROWS, spike


def test_a_sequence_first_batch_names_its_sequences_not_time_steps(tmp_path) -> None:
    """The batch is `(time, batch)`: dim 0 is time (word_language_model's layout). A
    one-sample replay of dim 0 is one time step of all 32 sequences: the GRU's pre-hook sees
    32 sequences, so the samples are replayed again as the batch's columns (dim 1), and the
    planted sequences are named."""
    report, norms, _ = _train(tmp_path, "observe", layout="seq_first")
    assert norms[K] >= 3 * max(norms[K - 20:K])  # the same spike, seen by the script
    spike = next(s for s in report["spikes"] if s["step"] == K)
    assert spike["cause"] == "bad_batch" and spike["rows"] == BAD_ROWS, spike
    assert "error" not in spike, spike


@pytest.mark.parametrize("policy", ["observe", "heal"])
def test_a_script_that_clips_is_judged_before_its_clip(tmp_path, policy) -> None:
    """The script clips to 0.2, below its usual grad norm (word_language_model's `--clip
    0.25` clips nearly every step): the gradients the optimizer sees all read ~0.2, the spike
    is only in the total its clip measured (`Guard.note_clip_norm`). Judged on the clipped
    norms, the run was `healthy` with no alarm."""
    report, norms, _ = _train(tmp_path / "plant", policy, clip=0.2)
    assert sorted(norms)[len(norms) // 2] > 0.2  # the clip acts on most steps
    assert norms[K] >= 3 * max(norms[K - 20:K]), norms[K - 5:K + 1]  # the script's own totals
    at_k = [a for a in report["alarms"] if a["step"] == K]
    assert at_k and at_k[0]["cause"] == "bad_batch", report["alarms"]
    assert at_k[0]["message"].startswith("grad norm before your clip ")
    spike = next(s for s in report["spikes"] if s["step"] == K)
    assert spike["rows"] == BAD_ROWS, spike
    assert report["status"] == ("warned" if policy == "observe" else "recovered")
    clean, _, _ = _train(tmp_path / "clean", policy, plant=False, clip=0.2)
    assert clean["status"] == "healthy" and not clean["alarms"], clean["alarms"]
