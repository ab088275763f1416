"""`nanguard run --preflight` / `--preflight-only` on realistic scripts in real subprocesses: a
deep MLP initialised far too large is flagged (the right layers) before its first NaN and the
later diagnosis uses the measurement; an LR above the probe's divergence point is flagged;
healthy MLP, CNN and transformer-LM scripts get no error-level finding; sigmoid -> BCELoss and
log(softmax) are found by running the forward; a preflight that cannot run says why and
training goes on; the CI gate's exit codes; and the run with --preflight trains bit for bit
what the run without it trains (parameters, optimizer state, every RNG stream).

`nanguard run` goes through `runner.run` in the test's process (what the command calls), its
output captured: a subprocess per run cost an interpreter start and a torch import each. The
plain run the bitwise test compares against keeps its own process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import preflight_scripts as scripts
import pytest
import torch

from nanguard.run.runner import RunOptions, run

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH")) if p)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    return e


_FLAGS = {"--preflight": "preflight", "--preflight-only": "preflight_only"}


def _run(tmp: Path, source: str, *options: str, args: tuple[str, ...] = (),
         name: str = "train.py", out: str = "run", replay: int = 0
         ) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """`nanguard run --out OUT --replay-budget R OPTIONS SCRIPT ARGS` from `tmp`, in this
    process: its exit code, what it and the script printed, and the report."""
    script = tmp / name
    script.write_text(source)
    stdout, stderr = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(tmp)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = run(RunOptions(script=str(script), args=list(args), out=str(tmp / out),
                                  replay_budget=replay, **{_FLAGS[o]: True for o in options}))
    finally:
        os.chdir(here)
    proc = subprocess.CompletedProcess(["nanguard", "run", *options, str(script), *args], code,
                                       stdout.getvalue(), stderr.getvalue())
    report = json.loads((tmp / out / "report.json").read_text())
    return proc, report


def _errors(pf: dict[str, Any]) -> list[dict[str, Any]]:
    return [f for f in pf["findings"] if f["severity"] == "error"]


def test_deep_mlp_bad_init_flagged_before_first_nan(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, scripts.DEEP_MLP_BAD_INIT, "--preflight", replay=120)
    pf = report["run"]["preflight"]
    assert pf["ran"], pf
    init = {f["location"]: f for f in pf["findings"] if f["code"] == "exploding_init"}
    # Every Linear with fan_in 128 has std 1 = 11.3x 1/sqrt(fan_in); the first (fan_in 32,
    # 5.7x) is large but not flagged.
    assert set(init) == {f"net.{i}" for i in (2, 4, 6, 8, 10, 12, 14)}
    assert all(f["severity"] == "error" for f in init.values())
    assert init["net.2"]["details"]["ratio"] == pytest.approx(11.3, abs=0.3)
    assert "kaiming_normal_(model.get_submodule('net.2').weight, nonlinearity='relu')" in \
        init["net.2"]["fix"]
    # The preflight ran at step 0; the run's first non-finite value came later.
    first = report["first_nonfinite"]
    assert first is not None and first["step"] >= 1
    assert first["module"] in init  # pinpointed by the re-run: one of the layers flagged
    assert "error exploding_init: 7 layer(s)" in proc.stderr
    assert "training continues" in proc.stderr
    assert report["status"] == "failed"
    # The diagnosis ranks the init first, with the failing layer's measured ratio.
    top = report["diagnosis"][0]
    assert top["cause"] == "exploding_init", report["diagnosis"]
    assert f"the failing layer `{first['module']}`: weight std" in top["evidence"]
    assert top["confidence"] > div_conf(report)
    assert "preflight" in top["evidence"]
    div = next(c for c in report["diagnosis"] if c["cause"] == "optimizer_divergence")
    assert "the preflight's LR probe diverged at lr" in div["evidence"]


def div_conf(report: dict[str, Any]) -> float:
    return max(c["confidence"] for c in report["diagnosis"] if c["cause"] != "exploding_init")


def test_lr_above_divergence_point_flagged(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, scripts.MLP, "--preflight-only", args=("5.0",))
    pf = report["run"]["preflight"]
    errs = _errors(pf)
    assert [f["code"] for f in errs] == ["optimizer_divergence"], pf["findings"]
    div = pf["lr_probe"]["diverge_lr"]
    assert div is not None and div <= 5.0
    msg = errs[0]["message"]
    assert msg.startswith(f"your lr=5 (SGD) is above the divergence point {div:.2g} found on "
                          f"this batch; try {div / 10:.2g}")
    assert proc.returncode == 1, proc.stderr
    assert "verdict: 1 error-level finding(s) (exit 1)" in proc.stderr
    assert "epoch" not in proc.stdout  # --preflight-only: no training
    assert report["status"] == "unwatched" and report["steps"] == 0


@pytest.mark.parametrize("source", [scripts.MLP, scripts.CNN, scripts.TRANSFORMER_LM],
                         ids=["mlp", "cnn", "transformer_lm"])
def test_healthy_scripts_get_no_error(tmp_path: Path, source: str) -> None:
    proc, report = _run(tmp_path, source, "--preflight-only")
    pf = report["run"]["preflight"]
    assert pf["ran"], pf
    assert _errors(pf) == [], pf["findings"]
    assert pf["overfit"]["success"], pf["overfit"]
    assert pf["lr_probe"]["diverge_lr"] > pf["optimizer"]["lr"]
    assert 0 < pf["seconds"] < 30  # a few seconds; loose for a shared CI machine
    assert proc.returncode == 0, proc.stderr
    assert "verdict: no errors" in proc.stderr


def test_transformer_lm_batch_and_loss_found(tmp_path: Path) -> None:
    """`logits.view(-1, V)` into cross_entropy, AdamW under a warm-up: the LR compared is the
    base LR (the scheduler's `initial_lr`), not the warm-up's first one."""
    _, report = _run(tmp_path, scripts.TRANSFORMER_LM, "--preflight-only")
    pf = report["run"]["preflight"]
    assert pf["model"] == "LM" and pf["loss"] == "cross_entropy"
    assert pf["optimizer"] == {"class": "AdamW", "lr": 3e-4}
    assert pf["batch"]["shapes"] == [[32, 32]]


def test_sigmoid_bce_and_unfloored_log_found_by_running_the_forward(tmp_path: Path) -> None:
    _, report = _run(tmp_path, scripts.SIGMOID_BCE, "--preflight-only", out="bce")
    codes = {f["code"]: f for f in report["run"]["preflight"]["findings"]}
    assert codes["saturated_loss"]["severity"] == "warning"
    assert "BCEWithLogitsLoss" in codes["saturated_loss"]["fix"]
    _, report = _run(tmp_path, scripts.LOG_SOFTMAX_BY_HAND, "--preflight-only", out="log")
    codes = {f["code"]: f for f in report["run"]["preflight"]["findings"]}
    assert codes["log_without_floor"]["severity"] == "warning"
    assert "log_softmax" in codes["log_without_floor"]["fix"]
    assert "saturated_loss" not in codes


def test_preflight_that_cannot_run_says_why_and_training_goes_on(tmp_path: Path) -> None:
    proc, report = _run(tmp_path, scripts.HAND_WRITTEN_LOSS, "--preflight")
    pf = report["run"]["preflight"]
    assert pf["ran"] is False and pf["reason"].startswith("the loss is not found")
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("nanguard preflight")]
    assert len(lines) == 1 and lines[0].endswith("training continues"), proc.stderr
    assert "done" in proc.stdout and report["steps"] == 5
    assert proc.returncode == 0
    # As a gate it cannot pass what it could not check.
    proc, report = _run(tmp_path, scripts.HAND_WRITTEN_LOSS, "--preflight-only", out="gate")
    assert proc.returncode == 2 and "done" not in proc.stdout


def test_preflight_is_bitwise_non_invasive(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(scripts.NON_INVASIVE)
    plain = subprocess.run([sys.executable, str(script), str(tmp_path / "plain.pt")],
                           cwd=tmp_path, env=_env(), capture_output=True, text=True,
                           timeout=120)
    assert plain.returncode == 0, plain.stderr
    for options, name in (((), "watched"), (("--preflight",), "preflight")):
        proc, report = _run(tmp_path, scripts.NON_INVASIVE, *options,
                            args=(str(tmp_path / f"{name}.pt"),), out=name)
        assert proc.returncode == 0, proc.stderr
    assert report["run"]["preflight"]["ran"]
    a = torch.load(tmp_path / "plain.pt")
    b = torch.load(tmp_path / "preflight.pt")
    c = torch.load(tmp_path / "watched.pt")
    for other in (b, c):
        assert a["model"].keys() == other["model"].keys()
        assert all(torch.equal(v, other["model"][k]) for k, v in a["model"].items())
        sa, so = a["opt"]["state"], other["opt"]["state"]
        assert all(torch.equal(sa[i][k], so[i][k]) for i in sa for k in sa[i])
        assert torch.equal(a["rng"], other["rng"]) and torch.equal(a["draw"], other["draw"])
        assert (a["py"], a["np"]) == (other["py"], other["np"])
        assert a["losses"] == other["losses"]
    # The guard recorded the script's own losses, none of the copies' (its hooks were quiet).
    with sqlite3.connect(tmp_path / "preflight" / "run.db") as db:
        recorded = [r[0] for r in db.execute("SELECT loss FROM steps ORDER BY step")]
    assert recorded == a["losses"]
