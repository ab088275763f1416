"""`nanguard export RUN --to TRACKER [--dest D]` on a recorded run folder, read back with each
tracker's own reader (TensorBoard's EventAccumulator, MLflow's client, the offline W&B log):
the NaN step is kept and marked. A missing folder, a folder that is not a run and an unknown
tracker give one line and exit 2, no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from export_rig import BAD, check_series, nan_run, read_wandb, wandb_series

from nanguard.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    nan_run(out)
    return out


def test_to_tensorboard(recorded, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main(["export", str(recorded), "--to", "tensorboard", "--dest",
                 str(tmp_path / "tb")]) == 0
    assert str(tmp_path / "tb") in capsys.readouterr().out
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    check_series(*({e.step: e.value for e in acc.Scalars(f"nanguard/{k}")}
                   for k in ("loss", "nonfinite", "skipped")))


def test_to_mlflow_folder(recorded, tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["export", str(recorded), "--to", "mlflow", "--dest", str(tmp_path / "ml"),
                 "--project", "exp"]) == 0
    rid = capsys.readouterr().out.split("run ")[-1].strip()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(tmp_path / "ml").as_uri())
    assert client.get_experiment(client.get_run(rid).info.experiment_id).name == "exp"
    check_series(*({m.step: m.value for m in client.get_metric_history(rid, f"nanguard/{k}")}
                   for k in ("loss", "nonfinite", "skipped")))


def test_to_wandb_offline(recorded, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert main(["export", str(recorded), "--to", "wandb", "--dest", str(tmp_path / "w")]) == 0
    [folder] = (tmp_path / "w" / "wandb").glob("offline-run-*")
    assert str(folder) in capsys.readouterr().out
    rows, summary, _ = read_wandb(folder, lambda rows, s: "nanguard/top_cause" in s)
    check_series(*(wandb_series(rows, k) for k in ("loss", "nonfinite", "skipped")))
    assert json.loads(summary["nanguard/first_nonfinite_step"]) == BAD


@pytest.mark.parametrize("args, says", [
    (["export", "{tmp}/nope", "--to", "tensorboard"], "no such run folder"),
    (["export", "{tmp}", "--to", "mlflow"], "not a nanguard run folder"),
    (["export", "{tmp}", "--to", "neptune"], "invalid choice"),
])
def test_bad_input_one_line(tmp_path, args, says):
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "nanguard",
                           *(a.format(tmp=tmp_path) for a in args)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert says in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if says != "invalid choice":  # argparse prints its usage first
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written, no tracker folder made
