"""Live warnings: each alarm episode reaches the person while the run goes, before the NaN.

The cascade (`nanguard.scenarios.cascade`, seed 0, the outlier planted at step 10) is trained by
a script that prints one line per step; where its first non-finite value appears is found
independently, by running the same script without nanguard and checking the loss and every
gradient. Under `nanguard run` (merged stdout and stderr, unbuffered) and under the Guard API,
nanguard's first warning line must come before the script's print of step N-3, with at most a
couple of dozen nanguard lines while it trains. Also: the `on_alarm` / `on_action` /
`on_finding` callbacks and their error containment, the standard ways to silence or redirect
the `nanguard` logger, and one line (plus a count) for a NaN that persists.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT
from nanguard import Guard, GuardConfig, RecordConfig
from nanguard.record.events import Episodes, Event
from nanguard.scenarios.cascade import make_cascade

SCRIPT = """\
import argparse
import torch
from nanguard.scenarios.cascade import make_cascade

p = argparse.ArgumentParser()
p.add_argument("--seed", type=int, default=0)
p.add_argument("--steps", type=int, default=40)
p.add_argument("--root-logging", action="store_true")
a = p.parse_args()
if a.root_logging:
    import logging
    logging.basicConfig(format="ROOT %(name)s %(levelname)s %(message)s")
s = make_cascade(a.seed, steps=a.steps, outlier_at=10)
for i, (x, y) in enumerate(s.batches):
    loss = s.loss_fn(s.model(x), y)
    s.optimizer.zero_grad()
    loss.backward()
    ok = bool(torch.isfinite(loss)) and all(
        bool(torch.isfinite(p.grad).all()) for p in s.model.parameters())
    s.optimizer.step()
    print(f"step {i} loss {loss.item():.4g} finite {ok}")
"""


def _run(tmp_path: Path, *args: str) -> list[str]:
    """Run `args` (python ...) with stdout and stderr merged, unbuffered: the lines in the
    order the person sees them."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH"))
                                        if p)
    proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    return proc.stdout.splitlines()


def _first_nonfinite(lines: list[str]) -> int:
    """N: the first step whose loss or any gradient is non-finite, from the script's prints."""
    for line in lines:
        m = re.match(r"step (\d+) loss \S+ finite (True|False)", line)
        if m and m.group(2) == "False":
            return int(m.group(1))
    raise AssertionError("the scenario did not fail: " + "\n".join(lines[-5:]))


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("live")
    (d / "train.py").write_text(SCRIPT)
    return d


@pytest.fixture(scope="module")
def first_bad(script: Path) -> int:
    return _first_nonfinite(_run(script, "train.py"))


@pytest.fixture(scope="module")
def default_run(script: Path) -> list[str]:
    """`nanguard run` at its defaults (policy observe, log level warning): the lines of one
    run that two tests read (a third interpreter start and training saved)."""
    return _run(script, "-m", "nanguard", "run", "--out", "run", "train.py")


def test_run_warns_before_the_print_of_step_n_minus_3(default_run: list[str],
                                                      first_bad: int) -> None:
    lines = default_run
    assert _first_nonfinite(lines) == first_bad  # nanguard changed nothing
    deadline = lines.index(next(x for x in lines if x.startswith(f"step {first_bad - 3} ")))
    warnings = [i for i, x in enumerate(lines) if re.match(r"nanguard: step \d+ \w+:", x)]
    assert warnings and warnings[0] < deadline, lines[: deadline + 3]
    last_step = max(i for i, x in enumerate(lines) if x.startswith("step "))
    while_training = [x for x in lines[:last_step] if x.startswith("nanguard:")]
    assert 2 <= len(while_training) <= 24, while_training
    # The non-finite step is said once, in the step it happened, before its own print.
    nonfinite = [i for i, x in enumerate(lines) if re.match(r"nanguard: step \d+ nonfinite:", x)]
    assert len(nonfinite) == 1
    assert nonfinite[0] < lines.index(next(x for x in lines if x.startswith(f"step {first_bad} ")))
    # ... and its persistence is one count at the end, not one line a step.
    assert any(re.search(r"non-finite values in \d+ of its steps", x) for x in lines)


def test_quiet_and_log_level(script: Path, default_run: list[str]) -> None:
    quiet = _run(script, "-m", "nanguard", "run", "--quiet", "--out", "q", "train.py")
    assert not [x for x in quiet if re.match(r"nanguard: step", x)]
    assert any(x.startswith("nanguard: failed") for x in quiet)  # the summary still prints
    debug = _run(script, "-m", "nanguard", "run", "--log-level", "debug", "--out", "d",
                 "train.py")
    count = [len([x for x in out if re.match(r"nanguard: step \d+ \w+:", x)])
             for out in (debug, default_run)]
    assert count[0] > count[1] > 0


def test_root_logging_takes_the_lines_once(script: Path) -> None:
    """A program that configured logging gets nanguard's records through its own handlers
    (propagation), and nanguard's terminal handler steps aside: never twice."""
    lines = _run(script, "-m", "nanguard", "run", "--out", "r", "train.py", "--root-logging")
    ours = [x for x in lines if re.match(r"nanguard: step", x)]
    root = [x for x in lines if x.startswith("ROOT nanguard WARNING step")]
    assert root and not ours


class _Lines(logging.Handler):
    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append("LOG " + record.getMessage())


def _train_api(tmp_path: Path, seed: int = 0, steps: int = 30, **guard_kwargs: object
               ) -> tuple[list[str], list[torch.Tensor]]:
    """The cascade under a Guard; the script's per-step lines and the `nanguard` logger's
    records in one list, in the order they happened."""
    sink: list[str] = []
    handler = _Lines(sink)
    logger = logging.getLogger("nanguard")
    logger.addHandler(handler)
    try:
        s = make_cascade(seed, steps=steps, outlier_at=10)
        cfg = GuardConfig(record=RecordConfig(out=str(tmp_path / "run"), summary=False))
        guard = Guard(s.model, s.optimizer, config=cfg, **guard_kwargs)  # type: ignore[arg-type]
        for i, (x, y) in enumerate(s.batches):
            loss = s.loss_fn(s.model(x), y)
            guard.watch(loss=loss, batch=(x, y))
            s.optimizer.zero_grad()
            loss.backward()
            s.optimizer.step()
            sink.append(f"step {i}")
        guard.close()
    finally:
        logger.removeHandler(handler)
    return sink, [p.detach().clone() for p in s.model.parameters()]


def test_api_warns_while_training_and_calls_back(tmp_path: Path, first_bad: int) -> None:
    alarms: list[Event] = []
    findings: list[Event] = []
    sink, _ = _train_api(tmp_path, on_alarm=alarms.append, on_finding=findings.append)
    deadline = sink.index(f"step {first_bad - 3}")
    logged = [i for i, x in enumerate(sink) if x.startswith("LOG step")]
    assert logged and logged[0] < deadline
    assert len([x for x in sink[:sink.index("step 29")] if x.startswith("LOG")]) <= 24
    # Every alarm reaches the callback, typed; the notable ones are those the log showed.
    assert alarms and all(isinstance(e, Event) and e.type == "alarm" for e in alarms)
    assert {(e.step, e.kind) for e in alarms} >= {(first_bad, "nonfinite")}
    assert all(isinstance(e.value, float) and e.signal and e.message for e in alarms)
    shown = [x for x in sink if x.startswith("LOG step") and " action " not in x]
    assert len(shown) == sum(e.notable for e in alarms) < len(alarms)
    # The finding, at close, with its cause.
    assert findings and findings[-1].data["cause"] is not None
    assert findings[-1].step == first_bad


def test_a_failing_callback_is_dropped_and_changes_nothing(tmp_path: Path) -> None:
    calls = []

    def broken(event: Event) -> None:
        calls.append(event)
        raise RuntimeError("my dashboard is down")

    # 14 steps: the spike at step 10 alarms, and every parameter is still finite at the end.
    s = make_cascade(0, steps=14, outlier_at=10)
    for x, y in s.batches:
        loss = s.loss_fn(s.model(x), y)
        s.optimizer.zero_grad()
        loss.backward()
        s.optimizer.step()
    plain = [p.detach().clone() for p in s.model.parameters()]
    sink, params = _train_api(tmp_path / "a", steps=14, on_alarm=broken)
    assert len(calls) == 1  # dropped after its first error
    assert any("raised at step" in x and "was removed" in x for x in sink)
    assert all(torch.equal(a, b) for a, b in zip(plain, params, strict=True))
    import json

    report = json.loads((tmp_path / "a" / "run" / "report.json").read_text())
    assert report["status"] == "warned"
    assert report["run"]["listener_errors"][0]["error"] == "RuntimeError: my dashboard is down"


def test_a_persisting_nan_is_one_line_and_a_count() -> None:
    ep = Episodes(quiet_steps=5)
    notable = [ep.see(0, "spike"), ep.see(1, "cascade"), ep.see(2, "cascade"),
               ep.see(3, "nonfinite")]
    assert notable == [True, True, False, True]
    ends = []
    for step in range(3, 200):
        if step > 3:
            assert ep.see(step, "nonfinite") is False
        ends.append(ep.tick(step, nonfinite=True))
    assert ends.count(None) == len(ends)  # a NaN keeps the episode open
    end = ep.tick(200, final=True)
    assert end is not None and end.data["nonfinite_steps"] == 197
    assert end.level == logging.WARNING
    # A new trouble after a quiet stretch is a new episode with a line of its own.
    ep2 = Episodes(quiet_steps=5)
    assert ep2.see(0, "spike")
    assert all(ep2.tick(s) is None for s in range(0, 5))
    assert ep2.tick(5) is not None
    assert ep2.see(6, "spike") is True


def test_silenced_the_standard_way(tmp_path: Path) -> None:
    logger = logging.getLogger("nanguard")
    old = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        sink, _ = _train_api(tmp_path)
    finally:
        logger.setLevel(old)
    assert not [x for x in sink if x.startswith("LOG")]


def test_step_and_close_listeners(tmp_path: Path) -> None:
    """`only="step"` gets each recorded step's signals (NaN/Inf kept); `only="close"` gets one
    `close` event with the report's dict after the finding, and no other listener gets it."""
    s = make_cascade(0, steps=20, outlier_at=10)
    guard = Guard(s.model, s.optimizer, config=GuardConfig(record=RecordConfig(
        out=str(tmp_path / "run"), summary=False)))
    seen: list[Event] = []
    guard.add_listener(seen.append)
    guard.add_listener(seen.append, only="step")
    guard.add_listener(seen.append, only="close")
    for x, y in s.batches:
        loss = s.loss_fn(s.model(x), y)
        guard.watch(loss=loss, batch=(x, y))
        s.optimizer.zero_grad()
        loss.backward()
        s.optimizer.step()
    report = guard.close()
    guard.close()  # a second close tells nobody again
    steps = [e for e in seen if e.type == "step"]
    assert [e.step for e in steps] == list(range(20))
    assert steps[15].data["loss"] == float("inf") and steps[15].data["nonfinite"] == 1.0
    assert steps[9].data["nonfinite"] == 0.0 and "grad_norm" in steps[9].data
    assert [e.type for e in seen if e.type == "close"] == ["close"]
    assert seen[-1].type == "close" and seen[-2].type == "finding"
    assert seen[-1].kind == report.status == "failed"
    assert seen[-1].data["first_nonfinite"]["step"] == 15
    with pytest.raises(ValueError, match="unknown event type"):
        guard.add_listener(seen.append, only="closing")


TQDM_SCRIPT = """\
import torch
from tqdm import tqdm
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in tqdm(range(30), desc="train", mininterval=0):
    x = torch.randn(8, 4)
    if i == 12:
        x[2, 1] = float("nan")
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_a_live_line_is_not_glued_to_a_tqdm_bar(tmp_path: Path) -> None:
    """The program's tqdm bar is lifted off the line while nanguard's line is written (it read
    `train:  40%|####      | 12/30 [...]nanguard: step 12 ...`), then drawn again."""
    (tmp_path / "bar.py").write_text(TQDM_SCRIPT)
    text = "\n".join(_run(tmp_path, "-m", "nanguard", "run", "--out", "r", "--replay-budget", "0",
                           "bar.py"))
    at = text.index("nanguard: step 12 nonfinite")
    assert text[at - 1] in "\r\n", repr(text[at - 80:at + 20])
    assert "100%" in text[at:]  # the bar went on after the line
