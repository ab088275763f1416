"""Every re-run path gives the same answer: step, phase, op, the user's line and the fix.

A failing step is pinpointed three ways: replayed in process before its update (the Guard's
`replay=` function, or the step `nanguard run` recorded by reference), run again from the
script's start with the checker armed (`nanguard run` when the step cannot be replayed in
process: here the recording is switched off), and `nanguard replay RUN` afterwards. The op
found ran on one line of the user's code: the line that called the model for a forward op, the
loss's line for a loss op, never the `optimizer.step()` line whose hook triggered the replay.
The expected step and phase come from the independent tracer (`scripts/_nantrace.py`), the
expected line from the script's own text.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from programs_support import SCRIPTS, Guarded, guarded, trace

SALES = "sales_mlp.py"
CASCADE_SCRIPT = "from nanguard.scenarios.cascade import train_cascade\ntrain_cascade(0)\n"


def _line_of(path: Path, marker: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if marker in t)


def _where(source: str, cwd: Path) -> str:
    """`path:line` with the path made absolute (each path names it from its own folder)."""
    path, _, line = source.rpartition(":")
    return f"{(cwd / path).resolve()}:{line}"


def _rerun_without_recipe(cwd: Path, script: str, *args: str) -> Guarded:
    """`nanguard run` with the step recorder switched off: no step can be replayed in process,
    so the finding comes from the re-run of the script with the checker armed (a process of
    its own, as always)."""
    from nanguard.pinpoint.recorded import StepRecorder

    boundary = StepRecorder.boundary

    def off(self: StepRecorder, roots: Any, **kw: Any) -> str:
        boundary(self, roots, **kw)
        return "switched off by the test"

    with mock.patch.object(StepRecorder, "boundary", off):
        return guarded(cwd, script, *args)


def _replay(folder: Path) -> dict[str, str]:
    """`nanguard replay RUN`: its source line and top cause's fix, as printed. Run in this
    process (the command's `main`, its exit code and stdout): the replay reads only the run
    folder, so a process of its own tested no boundary and cost an interpreter start."""
    from nanguard.cli.main import main

    out_buf, err_buf = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(folder.parent)  # where the command ran: it names paths from there
    try:
        with mock.patch.dict(os.environ, {"COLUMNS": "2000"}), \
                contextlib.redirect_stdout(out_buf), contextlib.redirect_stderr(err_buf):
            code = main(["replay", str(folder)])
    finally:
        os.chdir(old)
    out = out_buf.getvalue()
    assert code == 1, out + err_buf.getvalue()[-2000:]
    source = re.search(r"^\s+source: (.+)$", out, re.M)
    cause = re.search(r"^\s+cause: (\S+) — fix: (.+)$", out, re.M)
    assert source and cause and "matches the recorded finding" in out, out
    return {"source": source.group(1).strip(), "cause": cause.group(1),
            "fix": cause.group(2).strip()}


def _answer(g: Guarded, cwd: Path) -> dict[str, Any]:
    first, top = g.first, g.report["diagnosis"][0]
    return {"step": first["step"], "phase": first["phase"], "op": first["op"],
            "source": _where(first["source"], cwd), "cause": top["cause"], "fix": top["fix"]}


@pytest.mark.parametrize(("lr", "phase", "marker"), [
    ("0.3", "loss", "# LOSS LINE"),
    ("0.1", "forward", "# FORWARD LINE"),
])
def test_three_paths_agree_on_a_realistic_script(tmp_path: Path, lr: str, phase: str,
                                                 marker: str) -> None:
    dirs = [tmp_path / n for n in ("trace", "inprocess", "rerun")]
    for d in dirs:
        d.mkdir()
    script = str(SCRIPTS / SALES)
    with ThreadPoolExecutor(1) as pool:  # the tracer's process; both runs in this one
        traced = pool.submit(trace, dirs[0], SALES, "--lr", lr)
        a = guarded(dirs[1], SALES, "--lr", lr)
        b = _rerun_without_recipe(dirs[2], script, "--lr", lr)
        t = traced.result()
    assert t.first is not None and t.first["phase"] == phase, t
    assert a.report["run"]["replay"]["status"] == "in-process", a.explain()
    assert b.report["run"]["replay"]["status"] == "found", b.explain()
    expected = f"{(SCRIPTS / SALES).resolve()}:{_line_of(SCRIPTS / SALES, marker)}"
    one, two = _answer(a, dirs[1]), _answer(b, dirs[2])
    assert (one["step"], one["phase"], one["source"]) == (t.first["step"], phase, expected), \
        a.explain()
    assert one == two, (one, two)
    replayed = _replay(a.out)
    assert _where(replayed["source"], dirs[1]) == expected
    assert (replayed["cause"], replayed["fix"]) == (one["cause"], one["fix"])


def test_three_paths_agree_on_the_demo(tmp_path: Path) -> None:
    """`nanguard demo`'s seed 0 (Guard(replay=...) in process), its `nanguard replay`, and the
    same training run by `nanguard run` with the in-process replay off (the re-run): the
    `mse_loss` of the scenario's step, on its line."""
    from nanguard.cli.demo import _train
    from nanguard.scenarios import cascade
    from nanguard.show.live import muted

    (tmp_path / "script").mkdir()
    script = tmp_path / "script" / "train.py"
    script.write_text(CASCADE_SCRIPT)
    b = _rerun_without_recipe(script.parent, str(script))
    with muted():
        report, _ = _train(0, 300, tmp_path / "seed-0", "observe")
    first, top = report.first_nonfinite, report.diagnosis[0]
    assert first is not None
    path = Path(cascade.__file__)
    expected = f"{path.resolve()}:{_line_of(path, 'return loss_fn(model(x), y)')}"
    one = {"step": first["step"], "phase": first["phase"], "op": first["op"],
           "source": _where(first["source"], Path(os.getcwd()))}
    assert one == {"step": 155, "phase": "loss", "op": "aten.mse_loss", "source": expected}
    assert b.report["run"]["replay"]["status"] == "found", b.explain()
    assert {k: v for k, v in _answer(b, script.parent).items() if k in one} == one
    replayed = _replay(tmp_path / "seed-0")
    assert _where(replayed["source"], tmp_path) == expected
    assert (replayed["cause"], replayed["fix"]) == (top["cause"], top["fix"])
