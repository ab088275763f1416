"""A spike without a NaN is explained: the layers whose gradients carry it (from the measured
per-parameter norms against their healthy level) and, with a `replay` function, the samples
with outlying per-sample gradient norms. In the cascade scenario the rare outlier sample (row 0,
25x larger) is the cause of every early spike, and nanguard names it."""

from __future__ import annotations

import torch
from torch.nn.functional import mse_loss

import nanguard
from nanguard.config import GuardConfig, RecordConfig
from nanguard.scenarios.cascade import make_cascade, train_cascade


def _run(seed: int, replay: bool) -> nanguard.Report:
    guards: list[nanguard.Guard] = []

    def factory(model, optimizer):  # type: ignore[no-untyped-def]
        fn = (lambda b: mse_loss(model(b[0]), b[1])) if replay else None
        guards.append(
            nanguard.Guard(
                model,
                optimizer,
                out="",
                replay=fn,
                config=GuardConfig(record=RecordConfig(summary=False)),
            )
        )
        return guards[0]

    train_cascade(seed, factory)
    assert guards[0].report is not None
    return guards[0].report


def _outlier_steps(seed: int) -> dict[int, list[int]]:
    """Steps whose batch holds a planted outlier row, and which rows."""
    out = {}
    for i, (x, _) in enumerate(make_cascade(seed).batches):
        rows = (x.abs().amax(dim=1) > 10).nonzero().flatten().tolist()
        if rows:
            out[i] = rows
    return out


def test_spike_names_its_layers_and_the_outlier_sample() -> None:
    report = _run(0, replay=True)
    outliers = _outlier_steps(0)
    first = report.spikes[0]
    assert first["step"] in outliers  # the first spike is an outlier batch...
    assert first["samples"][0]["index"] == outliers[first["step"]][0]  # ...and names its row
    assert first["layers"] and all(d["ratio"] >= 10 for d in first["layers"])
    spike_alarm = next(a for a in report.alarms if a["kind"] == "spike")
    assert "carried by layers" in spike_alarm["message"] and "samples 0" in spike_alarm["message"]


def test_without_replay_only_layers_are_named() -> None:
    report = _run(0, replay=False)
    assert report.spikes and all(s["samples"] == [] for s in report.spikes)
    assert report.spikes[0]["layers"]


def test_spike_explanation_leaves_training_bitwise_unchanged() -> None:
    plain, _ = train_cascade(0, steps=150)
    guards: list[nanguard.Guard] = []

    def factory(model, optimizer):  # type: ignore[no-untyped-def]
        guards.append(
            nanguard.Guard(
                model,
                optimizer,
                out="",
                replay=lambda b: mse_loss(model(b[0]), b[1]),
                config=GuardConfig(record=RecordConfig(summary=False)),
            )
        )
        return guards[0]

    watched, _ = train_cascade(0, factory, steps=150)
    assert guards[0].report is not None and guards[0].report.spikes  # it did explain one
    for a, b in zip(plain.model.parameters(), watched.model.parameters(), strict=True):
        assert torch.equal(a, b)
