"""benchmarks/norm_native.py and benchmarks/gate_cost.py run and print their JSON line (smoke
tests: no timing asserted; norm_native behind the marker `bench`, which CI runs; gate_cost
checks that the gate takes a healthy series' steps, in the default run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # norm_native imports host_cost
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.bench
def test_norm_native_quick(capsys: pytest.CaptureFixture[str],
                           monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _load("norm_native", monkeypatch)
    assert mod.main(["--steps", "2", "--warmup", "1", "--no-compile",
                     "--workloads", "logreg"]) == 0
    assert torch.is_grad_enabled()  # the benchmark leaves the process as it found it
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(result["logreg"]) >= {"per_tensor", "foreach_list", "foreach_buffer", "clip"}


def test_gate_cost_quick(capsys: pytest.CaptureFixture[str],
                         monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _load("gate_cost", monkeypatch)
    assert mod.main(["--rounds", "1", "--steps", "300"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gate_share"] > 0.9  # a healthy series: the gate takes its steps
