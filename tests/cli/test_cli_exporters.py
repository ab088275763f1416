"""The exporters as the docs show them, with the packages the extras install: the MLflow stream
works with no MLFLOW_TRACKING_URI (mlflow-skinny cannot open MLflow 3's default SQLite store:
the run goes to RUN/mlruns, and it says so), and `nanguard export RUN --to wandb` with no W&B
login is the user's setup, one line naming WANDB_MODE=offline, exit 2 (not "a bug")."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nanguard import Guard
from nanguard.cli.main import main

NAN_AT = 4


def _train(out: Path, stream_to: object = None) -> tuple[Guard, object]:
    """Six SGD steps of a Linear, the loss NaN at step NAN_AT (one input row of NaN)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, out=str(out))
    guard.config.record.summary = False
    handle = stream_to(guard) if callable(stream_to) else None
    for step in range(6):
        x = torch.randn(8, 4)
        if step == NAN_AT:
            x[0, 0] = float("nan")
        loss = model(x).pow(2).mean()
        guard.watch(loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    guard.close()
    return guard, handle


def test_mlflow_stream_without_a_tracking_uri(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from nanguard.export import mlflow as ng_mlflow

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)  # whatever an earlier test in this process chose: unset
    out = tmp_path / "run"
    _, handle = _train(out, ng_mlflow.stream)
    skinny = importlib.util.find_spec("sqlalchemy") is None
    uri = (out / "mlruns").resolve().as_uri() if skinny else mlflow.get_tracking_uri()
    if skinny:  # said once, with where the run went
        assert any(uri in r.getMessage() and "MLFLOW_TRACKING_URI" in r.getMessage()
                   for r in caplog.records), caplog.text
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 opens a file store so
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(handle.run_id)  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED" and run.data.tags["nanguard.status"] == "failed"
    loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id,
                                                               "nanguard/loss")}
    assert sorted(loss) == list(range(6)) and math.isnan(loss[NAN_AT])
    assert all(math.isfinite(loss[s]) for s in range(NAN_AT))


def test_wandb_without_a_login_is_the_users_setup(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    wandb = pytest.importorskip("wandb")
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no saved login
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    _train(out)
    # `wandb.setup()` reads the environment once per process: an earlier test's offline W&B in
    # this worker would otherwise stand in for the missing login (and this test's setup must
    # not outlive it either).
    wandb.teardown()
    try:
        code = main(["export", str(out), "--to", "wandb"])
    finally:
        wandb.teardown()
    assert code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("nanguard export: error: --to wandb:"), lines
    assert "WANDB_MODE=offline" in lines[0] and "wandb login" in lines[0]
    assert "bug" not in lines[0]
