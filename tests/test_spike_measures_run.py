"""Spike measures of a real training run: a tiny MLP fitted by Adam at a too-high LR with
warm-up (lr 0.03, 50 warm-up steps, 2000 full-batch steps) under a Guard. Once the loss is near
zero Adam's second moments decay and the loss spikes by orders of magnitude, recovering in
10-20 steps, again and again (the "slingshot"). report.json must hold the measures and they
must equal an independent numpy computation over the losses the loop saw (run.db is compacted
past 1000 steps: the measures still count every step). Also: the terminal summary line and the
HTML report's episode shading, a healthy run's measures, and a report.json written before the
key existed."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import nanguard
from nanguard import GuardConfig, RecordConfig
from nanguard.record.report import load_report
from nanguard.show.summary import heal_line, report_spike_line, spike_line
from test_spike_measures import ref_score


def ref_episodes(xs: list[float], window: int = 1000, min_window: int = 20, sigmas: float = 7.0,
                 floor: float = 1e-6, tol: float = 0.1) -> list[tuple[int, int | None]]:
    """(start, recovered_at) of each loss episode, straight from the definition."""
    hist: list[float] = []
    out: list[tuple[int, int | None]] = []
    level: float | None = None
    start = None
    for i, x in enumerate(xs):
        if start is not None and math.isfinite(x) and (level is None or
                                                       x <= level + tol * abs(level)):
            out.append((start, i))
            start = None
        elif start is None:
            up = not math.isfinite(x)
            if math.isfinite(x) and len(hist) >= min_window:
                w = np.array(hist[-window:])
                up = x - w.mean() > sigmas * max(w.std(), floor * abs(w.mean()))
            if up:
                start, level = i, (float(np.mean(hist[-window:])) if hist else None)
        if math.isfinite(x):
            hist.append(x)
    return out + ([(start, None)] if start is not None else [])


def slingshot(out: Path, *, lr: float = 0.03, steps: int = 2000,
              stream: Callable[[nanguard.Guard], object] | None = None) -> list[float]:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    y = torch.sin(2 * x[:, :1]) + x[:, 1:2]
    losses = []
    with nanguard.Guard(model, opt, config=GuardConfig(record=RecordConfig(
            out=str(out), summary=False))) as guard:
        if stream is not None:
            stream(guard)
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            guard.watch(loss=loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    return losses


@pytest.fixture(scope="module")
def spiky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    from nanguard.export.tensorboard import stream

    out = tmp_path_factory.mktemp("spiky") / "run"
    # Streamed live to TensorBoard as it trains (observing: the run is the same without it).
    return out, slingshot(out, stream=lambda g: stream(g, log_dir=out.parent / "tb"))


def test_report_holds_measures_equal_to_an_independent_computation(
        spiky: tuple[Path, list[float]]) -> None:
    out, losses = spiky
    m = json.loads((out / "report.json").read_text())["spike_measures"]
    spikes, scored = ref_score(losses)
    assert (m["spike_steps"]["loss"], m["steps_scored"]["loss"]) == (spikes, scored)
    assert m["score"]["loss"] == pytest.approx(spikes / scored)
    eps = ref_episodes(losses)
    assert len(eps) >= 2  # the scenario does spike, and recovers
    assert [(e["start"], e["recovered_at"]) for e in m["episodes"]] == eps
    in_spike = sum((end if end is not None else len(losses)) - s for s, end in eps)
    assert m["steps_in_spike"] == in_spike and m["steps"] == len(losses)
    assert m["time_in_spike"] == pytest.approx(in_spike / len(losses))
    assert m["complete"] and m["score"]["grad_norm"] is not None
    first = m["episodes"][0]
    assert first["peak_value"] >= first["value"] > first["baseline"]
    assert set(first["before"]) >= {"grad_norm"} and first["before"]["grad_norm"]["ratio"] > 0


def test_summary_line_and_html_shading(spiky: tuple[Path, list[float]], tmp_path: Path) -> None:
    pytest.importorskip("bokeh")
    from nanguard.show.html import write_html

    out, _ = spiky
    report = load_report(out)
    line = spike_line(report.spike_measures)
    n = report.spike_measures["episodes_total"]
    assert line is not None and line.startswith(f"spikes: {n} episodes, ")
    assert (heal_line(report) or "").startswith("remedy: policy='heal'")  # spikes it came back from
    assert "of steps in spike; spike score loss " in line and "grad norm" in line
    page = write_html([str(out)], tmp_path / "r.html").read_text()
    assert '"spike_episode"' in page and "spike at step " in page
    assert 'class=\\"spikes\\"' in page  # the header, inside the page's JSON payload
    assert 'class=\\"heal\\"' in page and "remedy: policy=" in page  # the heal line too


def test_healthy_run_has_measures_and_an_old_report_gets_them(tmp_path: Path) -> None:
    out = tmp_path / "healthy"
    slingshot(out, lr=1e-3, steps=120)
    path = out / "report.json"
    m = json.loads(path.read_text())["spike_measures"]
    assert m["episodes"] == [] and m["steps"] == 120 and m["steps_scored"]["loss"] == 100
    assert spike_line(m) == ("spikes: 0 episodes, 0.0% of steps in spike; spike score loss "
                             "0.0%, grad norm 0.0%" + (", update ratio 0.0%" if
                                                        m["score"]["update_ratio"] is not None
                                                        else ""))
    old = json.loads(path.read_text())
    del old["spike_measures"]  # as a nanguard before the key wrote it (and before the
    old.pop("schema_version", None)  # schema: both keys came in the same release)
    path.write_text(json.dumps(old))
    assert load_report(out).spike_measures == m


def test_summary_leaves_out_the_spike_line_when_the_only_episode_is_the_failure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN row in every batch from some step on: each step from there is "in spike" by the
    measure's definition, which says nothing the failure does not, so the summary leaves the
    line out; a run that spiked and came back before it broke keeps it (its episodes count
    what came before the failure)."""
    def train(out: Path, nan_from: int, spike_at: int | None = None) -> str:
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        guard = nanguard.Guard(model, opt, out=out)
        for step in range(30):
            x = torch.randn(8, 4)
            y = torch.full((8, 1), 1.0)
            if step == spike_at:
                y[0] = 40.0  # one mislabelled row: the loss jumps, the next step is back
            if step >= nan_from:
                x[3, 1] = float("nan")
            loss = ((model(x) - y) ** 2).mean()
            guard.watch(loss=loss, batch=x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        guard.close()
        return capsys.readouterr().err  # the summary goes to stderr

    for nan_from in (0, 25):
        err = train(tmp_path / f"at{nan_from}", nan_from)
        assert "failed after 30 steps" in err and "of steps in spike" not in err
        # Its one episode is its end in NaN: not the spikes `heal` is for.
        assert "remedy: policy='heal'" not in err
    err = train(tmp_path / "spiked", nan_from=27, spike_at=22)
    assert "failed after 30 steps" in err and "spikes: 2 episodes (1 open)" in err, err


def test_live_stream_plots_the_measures_step_by_step(spiky: tuple[Path, list[float]]) -> None:
    """The TensorBoard stream of the spiky run: `in_spike` is 1 exactly on the steps of the
    independently computed episodes, and the last step's running score, episode count and time
    in spike are the report's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, losses = spiky
    acc = EventAccumulator(str(out.parent / "tb"), size_guidance={"scalars": 0})
    acc.Reload()

    def series(tag: str) -> dict[int, float]:
        return {e.step: e.value for e in acc.Scalars(f"nanguard/{tag}")}

    in_spike = series("in_spike")
    assert sorted(in_spike) == list(range(len(losses)))
    expected = {i for s, end in ref_episodes(losses)
                for i in range(s, end if end is not None else len(losses))}
    assert {i for i, v in in_spike.items() if v == 1.0} == expected
    m = json.loads((out / "report.json").read_text())["spike_measures"]
    last = len(losses) - 1
    assert series("spike_episodes")[last] == m["episodes_total"] == len(ref_episodes(losses))
    assert series("time_in_spike")[last] == pytest.approx(m["time_in_spike"], rel=1e-6)
    spikes, scored = ref_score(losses)
    assert series("spike_score_loss")[last] == pytest.approx(spikes / scored, rel=1e-6)
    assert 0 < series("spike_score_grad_norm")[last] < 1


def test_no_heal_remedy_on_a_run_the_guard_found_healthy(
        spiky: tuple[Path, list[float]]) -> None:
    """The spike measure counts episodes on any noisy loss (off-policy RL, a GAN): the remedy
    is offered only where the guard raised an alarm of its own, on a stationary objective."""
    out, _ = spiky
    report = load_report(out)
    assert report.alarms and heal_line(report)  # the spiky run: alarms, episodes, remedy
    quiet = dataclasses.replace(report, alarms=[], status="healthy")
    assert heal_line(quiet) is None
    off = dataclasses.replace(report, actions=[*report.actions, {
        "step": 0, "action": "loss_trend_off", "detail": "a new rollout each iteration"}])
    assert heal_line(off) is None


def test_no_loss_episodes_where_the_guard_judged_the_loss_not_stationary(
        spiky: tuple[Path, list[float]]) -> None:
    """A critic's loss that grows with the returns (SAC on Pendulum: 2 "episodes", 28% of
    steps "in spike", on a healthy run) is no spike: where the guard turned its loss-trend
    alarms off for the part measured, the line counts no loss episodes and says why; an
    action for another part leaves the line as it was."""
    import dataclasses

    out, _ = spiky
    report = load_report(out)
    m = report.spike_measures
    assert m["episodes_total"] > 0
    off = {"step": 5, "action": "loss_trend_off", "detail": "not stationary"}
    judged = dataclasses.replace(report, actions=[*report.actions, off])
    line = report_spike_line(judged)
    assert line is not None and line.startswith("spikes: not counted on the loss")
    assert "episode" not in line and "grad norm" in line and "loss 0" not in line
    other = dataclasses.replace(report, actions=[*report.actions, {**off, "part": "other"}])
    assert report_spike_line(other) == report_spike_line(report) == spike_line(m)
