"""An epoch's short last batch is not a spike (`detect.short_batch`).

Seen on pytorch/examples' word_language_model (BENCHMARKS.md "Held-out bad batches on
word_language_model"): every epoch ends with a batch of 9 rows where the others hold 35; its
grad norm is 1.9-2x theirs on clean data, and a healthy run ended `warned` with two grad-norm
"spikes" and a diagnosis of optimizer divergence ("lower the LR 10x"). A gradient is a mean
over the batch: its noise grows as 1/sqrt(rows).

Here a real tiny training with a `DataLoader` that keeps its short last batch (4112 samples in
batches of 256: 16 full batches and one of 16), noisy labels (a noise-dominated gradient). The
premise is measured by the script itself (its own grad norm at each short batch against the
full batches before it: 2.9-5.4x) and by the detector without the batch's size (a spike at
step 50: the test is not vacuous). A short batch is judged as a full batch of the same noise
would be, so a really bad one still spikes (the control: its inputs 100x).
"""

from __future__ import annotations

import json
import statistics

import torch
from torch.utils.data import DataLoader, TensorDataset

from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.detect import spike

EPOCHS = 10
N, BATCH = 4112, 256  # 16 full batches and a last one of 16 per epoch


def _train(tmp_path, bad_step: int | None = None, act: type = torch.nn.Tanh
           ) -> tuple[dict, dict[int, float], list[int]]:
    """The run under `observe`; its report, the script's own grad norm of every step and the
    steps of the short batches."""
    torch.manual_seed(0)
    x = torch.randn(N, 16)
    y = (x[:, 0] > 0).long()
    flip = torch.rand(N) < 0.3  # noisy labels: most of each gradient is noise
    y[flip] = 1 - y[flip]
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), act(), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = Guard(model, opt, config=GuardConfig(
        policy="observe", record=RecordConfig(out=str(tmp_path), summary=False)))
    norms: dict[int, float] = {}
    short: list[int] = []
    step = 0
    for _ in range(EPOCHS):
        for xb, yb in loader:
            if len(xb) < BATCH:
                short.append(step)
                if step == bad_step:
                    xb = xb * 10.0
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            g.watch(loss=loss, batch=(xb, yb))
            opt.zero_grad()
            loss.backward()
            norms[step] = float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters())))
            opt.step()
            step += 1
    g.close()
    return json.loads((tmp_path / "report.json").read_text()), norms, short


def _ratio(norms: dict[int, float], step: int) -> float:
    return norms[step] / statistics.median(norms[s] for s in range(step - 16, step))


def test_a_short_last_batch_raises_no_spike(tmp_path) -> None:
    report, norms, short = _train(tmp_path)
    late = [s for s in short if s >= 60]
    # the premise, from the script's own grad norms: the short batches' are far above the rest
    assert min(_ratio(norms, s) for s in late) >= 1.8, [round(_ratio(norms, s), 2) for s in late]
    spikes = [a for a in report["alarms"] if a["kind"] == "spike"]
    assert not spikes, [a["message"] for a in spikes]
    assert report["status"] == "healthy"


def test_without_the_batch_size_the_same_run_has_a_false_spike(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(spike, "noise_scale", lambda rows, usual: 1.0)
    report, _, short = _train(tmp_path)
    steps = {a["step"] for a in report["alarms"] if a["kind"] == "spike"}
    assert steps and steps <= set(short), report["alarms"]


def test_a_short_batch_that_is_really_bad_still_spikes(tmp_path) -> None:
    # (a ReLU net: a tanh one saturates, and its gradient hardly grows with its inputs)
    _, _, short = _train(tmp_path / "first", act=torch.nn.ReLU)
    bad = [s for s in short if s >= 100][0]
    report, norms, _ = _train(tmp_path / "bad", bad_step=bad, act=torch.nn.ReLU)
    assert _ratio(norms, bad) >= 20.0  # what the script itself saw
    steps = {a["step"] for a in report["alarms"] if a["kind"] == "spike"}
    assert bad in steps, report["alarms"]
